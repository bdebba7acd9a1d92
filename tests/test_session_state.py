"""Session state that outlives a request, on a real 3-stage pipeline: resident prefixes (a chat's
next turn starts from the KV its previous turn left behind), TrimSession, and KV pages.

The reference is llama-cpp-python's ``Llama`` fed the same requests in the same order: it
keeps the KV of its previous prompt and reuses the longest common prefix, which is the rule
the head applies, so the suffix prefills have the same shapes and the texts must be equal.
A stage that lost its prefixes (restarted) makes the head prefill in full: same text.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from support.chat import MAX_TOKENS, TURNS, chat, reference_chat
from support.pipeline import StreamingRun, assert_no_active_sessions, grpc_generate, metric, scrape, status
from support.waiting import eventually

from skippy_stage.cli.local import LocalPipeline, free_ports, pipeline_configs
from skippy_stage.model.loader import reference_llama
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

RANGES = [(0, 10), (10, 20), (20, 30)]
STAGE_OPTIONS = {"n_threads": 1, "kv_unified": False}


@pytest.fixture(scope="module")
def reference(smollm2):
    return reference_chat(smollm2, TURNS)


@pytest.fixture(scope="module")
def pipeline(start_pipeline, smollm2):
    http, *metrics_ports = free_ports("127.0.0.1", 4)
    p = start_pipeline(smollm2, RANGES, http_port=[http, None, None], metrics_port=metrics_ports, **STAGE_OPTIONS)
    p.http = http
    p.metrics_ports = metrics_ports
    yield p
    p.stop()


def client_of(pipeline) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{pipeline.http}/v1", api_key="unused", max_retries=0, timeout=120)


def statuses(pipeline) -> list[pb.StageStatus]:
    out = []
    for cfg in pipeline.configs:
        with grpc.insecure_channel(f"127.0.0.1:{cfg['bind_addr'].rsplit(':', 1)[1]}") as channel:
            out.append(pb_grpc.StageServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10))
    return out


def test_a_four_turn_chat_over_three_stages_reuses_each_turn_and_equals_llama(pipeline, reference, smollm2):
    before = scrape(pipeline.metrics_ports[0])
    answers, cached = chat(client_of(pipeline), smollm2.name, TURNS)
    print("answers:", answers, "cached tokens per turn:", cached)
    assert answers == reference
    assert all(c > 0 for c in cached[1:])  # every later turn started from the previous one's KV
    after = scrape(pipeline.metrics_ports[0])
    hits = metric(after, "skippy_prefix_cache_hits_total") - metric(before, "skippy_prefix_cache_hits_total")
    reused = (metric(after, "skippy_prefix_cache_tokens_reused_total")
              - metric(before, "skippy_prefix_cache_tokens_reused_total"))
    assert hits >= 3 and reused >= sum(cached[1:])
    # Every stage keeps the last turn's KV, under the same id — once the head's retire of the turn's
    # session (after its last token) has run down the chain.
    reports = eventually(lambda: statuses(pipeline), lambda rs: all(
        r.resident_prefixes and r.active_sessions == 0 for r in rs))
    for report in reports:
        assert report.resident_prefixes and all(p.tokens > 0 for p in report.resident_prefixes)
        assert report.active_sessions == 0
    assert len({tuple(sorted(p.prefix_id for p in s.resident_prefixes)) for s in reports}) == 1


def drop_calls(port: int) -> float:
    """DropSession calls the stage answered, whatever their status (none yet: 0)."""
    text = scrape(port)
    total = 0.0
    for code in ("OK", "NOT_FOUND", "UNAVAILABLE", "INVALID_ARGUMENT"):
        try:
            total += metric(text, "skippy_requests_total", rpc="DropSession", code=code)
        except AssertionError:
            pass
    return total


def test_finished_sessions_end_in_band_without_a_call_down_the_chain(pipeline):
    """More generations than lanes, at once: each finished session is retired (or dropped) on every
    stage by one in-band message ahead of the next frame — no DropSession call crosses an edge, the
    queued requests get the freed lanes, every stage ends with no live session and the same resident
    prefixes, and a follow-up starts from one of them."""
    calls = [drop_calls(port) for port in pipeline.metrics_ports[1:]]
    client = client_of(pipeline)
    prompts = [f"Write one sentence about the number {n}." for n in range(7)]  # 7 on 4 lanes: 3 wait
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: client.completions.create(
            model="m", prompt=p, max_tokens=6, temperature=0).choices[0].text, prompts))
    reports = eventually(lambda: statuses(pipeline), lambda rs: all(r.active_sessions == 0 for r in rs))
    prefixes = [sorted(p.prefix_id for p in r.resident_prefixes) for r in reports]
    assert prefixes[0] and prefixes == [prefixes[0]] * len(reports), prefixes
    assert [drop_calls(port) for port in pipeline.metrics_ports[1:]] == calls
    again = client.completions.create(model="m", prompt=prompts[-1], max_tokens=6, temperature=0)
    assert again.choices[0].text == texts[-1]
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_more_conversations_than_idle_slots_evict_prefixes_and_every_text_stays_exact(start_pipeline, smollm2):
    """One resident slot, three conversations taking turns: most turns find their prefix gone."""
    conversations = [["Name a fruit.", "Name another one."], ["What is 2 + 2?", "And 3 + 3?"],
                     ["Say hello.", "Say goodbye."]]
    http = free_ports("127.0.0.1", 1)[0]
    p = start_pipeline(smollm2, RANGES, http_port=[http, None, None], cache_idle_slots=1, **STAGE_OPTIONS)
    try:
        p.http = http
        client = client_of(p)
        llm = reference_llama(smollm2, n_ctx=2048, verbose=False)
        histories: list[list[dict]] = [[] for _ in conversations]
        for turn in range(2):
            for history, questions in zip(histories, conversations):
                history.append({"role": "user", "content": questions[turn]})
                want = llm.create_chat_completion(history, temperature=0, max_tokens=MAX_TOKENS)
                got = client.chat.completions.create(model=smollm2.name, messages=history, temperature=0,
                                                     max_tokens=MAX_TOKENS)
                assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
                history.append({"role": "assistant", "content": got.choices[0].message.content})
        llm.close()
        for status in statuses(p):
            assert len(status.resident_prefixes) <= 1
    finally:
        p.stop()


def test_a_stage_that_lost_its_prefixes_makes_the_head_prefill_in_full_with_the_same_text(pipeline, smollm2):
    client = client_of(pipeline)
    turns = ["Tell me a fact about cats.", "Tell me one more."]
    expected = reference_chat(smollm2, turns)
    first = client.chat.completions.create(model=smollm2.name, messages=[{"role": "user", "content": turns[0]}],
                                           temperature=0, max_tokens=MAX_TOKENS)
    misses_before = metric(scrape(pipeline.metrics_ports[0]), "skippy_prefix_cache_misses_total")
    os.kill(pipeline.procs[2].pid, signal.SIGKILL)  # the final stage comes back empty: no resident prefixes
    pipeline.procs[2].wait()
    pipeline.restart(2)
    pipeline.wait_serving(180)
    deadline = time.monotonic() + 60
    while True:
        try:
            second = client.chat.completions.create(
                model=smollm2.name, temperature=0, max_tokens=MAX_TOKENS,
                messages=[{"role": "user", "content": turns[0]},
                          {"role": "assistant", "content": first.choices[0].message.content},
                          {"role": "user", "content": turns[1]}])
            break
        except openai.APIStatusError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)  # the head may still see the restarted edge as down
    assert [first.choices[0].message.content, second.choices[0].message.content] == expected
    assert second.usage.prompt_tokens_details.cached_tokens == 0  # the miss fell back to a full prefill
    # the head named the first turn's prefix, which the restarted stage no longer held
    assert metric(scrape(pipeline.metrics_ports[0]), "skippy_prefix_cache_misses_total") > misses_before


def test_the_head_grpc_generate_reports_the_cached_tokens_of_a_follow_up(pipeline):
    messages = [pb.ChatMessage(role="user", content="Count from one to three.")]
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        stub = pb_grpc.StageServiceStub(channel)

        def ask() -> tuple[str, pb.GenerateResponse]:
            request = pb.GenerateRequest(max_tokens=MAX_TOKENS, messages=messages,
                                         sampling=pb.SamplingParams(temperature=0.0))
            pieces, last = [], None
            for msg in stub.Generate(request, timeout=120):
                pieces.append(msg.text)
                last = msg if msg.done else last
            return "".join(pieces), last

        text, _ = ask()
        messages.extend([pb.ChatMessage(role="assistant", content=text),
                         pb.ChatMessage(role="user", content="Now from four to six.")])
        _, last = ask()
    assert 0 < last.cached_tokens < last.prompt_tokens


def test_trim_session_cuts_every_stage_in_one_call_and_refuses_by_field(pipeline):
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        entry = pb.BatchEntry(session_id="trim-me", phase=pb.PHASE_PREFILL, positions=range(5),
                              token_ids=[1, 2, 3, 4, 5], sample_last=True)
        stub.IterationBatch(pb.IterationBatchRequest(request_id="t", entries=[entry]), timeout=60)
        reply = stub.TrimSession(pb.TrimSessionRequest(session_id="trim-me", tokens=3), timeout=30)
        assert [(s.stage_id, s.tokens_before) for s in reply.stages] == [
            ("stage-0", 5), ("stage-1", 5), ("stage-2", 5)]
        with pytest.raises(grpc.RpcError) as err:
            stub.TrimSession(pb.TrimSessionRequest(session_id="trim-me", tokens=4), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens=4" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.TrimSession(pb.TrimSessionRequest(session_id="nobody", tokens=0), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nobody" in err.value.details()
        # the cut session continues at position 3
        entry = pb.BatchEntry(session_id="trim-me", phase=pb.PHASE_DECODE, positions=[3], token_ids=[7],
                              sample_last=True)
        stub.IterationBatch(pb.IterationBatchRequest(request_id="t2", entries=[entry]), timeout=60)
        stub.DropSession(pb.DropSessionRequest(session_id="trim-me"), timeout=30)


def test_export_and_import_over_grpc_fork_a_session_on_a_stage_and_refuse_a_foreign_page(pipeline):
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        head = pb_grpc.StageServiceStub(channel)
        entry = pb.BatchEntry(session_id="page-me", phase=pb.PHASE_PREFILL, positions=range(4),
                              token_ids=[1, 2, 3, 4], sample_last=True)
        head.IterationBatch(pb.IterationBatchRequest(request_id="p", entries=[entry]), timeout=60)
        stage1 = f"127.0.0.1:{pipeline.configs[1]['bind_addr'].rsplit(':', 1)[1]}"
        with grpc.insecure_channel(stage1) as channel1:
            stub = pb_grpc.StageServiceStub(channel1)
            page = stub.ExportSession(pb.ExportSessionRequest(session_id="page-me"), timeout=30)
            assert (page.descriptor.layer_start, page.descriptor.layer_end, page.descriptor.n_tokens) == (10, 20, 4)
            assert len(page.descriptor.model_digest) == 64 and page.data
            reply = stub.ImportSession(pb.ImportSessionRequest(session_id="page-copy", page=page), timeout=30)
            assert reply.tokens == 4
            foreign = pb.KvPage()
            foreign.CopyFrom(page)
            foreign.descriptor.layer_end = 30
            with pytest.raises(grpc.RpcError) as err:
                stub.ImportSession(pb.ImportSessionRequest(session_id="page-other", page=foreign), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "page.descriptor.layer_end=30" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                stub.ExportSession(pb.ExportSessionRequest(session_id="nobody"), timeout=30)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            # a page must hold exactly the tokens its caller has sent: more is refused at once,
            # fewer after waiting out the call's deadline for the frames on their way
            for wanted, deadline in ((3, 30), (6, 1)):
                with pytest.raises(grpc.RpcError) as err:
                    stub.ExportSession(pb.ExportSessionRequest(session_id="page-copy", wait_for_tokens=wanted),
                                       timeout=deadline)
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert f"wait_for_tokens={wanted}" in err.value.details() and "holds 4 tokens" in err.value.details()
            # release: the session moved; its lane here is free
            moved = stub.ExportSession(pb.ExportSessionRequest(session_id="page-copy", wait_for_tokens=4,
                                                               release=True), timeout=30)
            assert moved.descriptor.n_tokens == 4 and len(moved.data) == len(page.data)
            with pytest.raises(grpc.RpcError) as err:
                stub.ExportSession(pb.ExportSessionRequest(session_id="page-copy"), timeout=30)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        head.DropSession(pb.DropSessionRequest(session_id="page-me"), timeout=30)


@pytest.mark.parametrize(("draining", "seeded"), [(1, False), (2, False), (2, True)],
                         ids=["middle-stage", "final-stage", "final-stage-seeded"])
def test_a_draining_stage_hands_its_sessions_and_prefixes_to_its_stand_in_and_the_text_is_unchanged(
        draining, seeded, smollm2, slice_cache, tmp_path):
    """The stage above lists a stand-in for the same layers: on SIGTERM it moves the live
    session's KV page there (no re-prefill: the head recovers nothing) and then the resident
    prefixes; the generation goes on with the text it would have had, a later request still finds
    its prefix, and the drained stage exits 0 as soon as its sessions have left. Seeded at
    temperature > 0 as well: the stand-in's sampler skips the draws the drained one made."""
    sampling = pb.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=5) if seeded else None
    ports = free_ports("127.0.0.1", 8)
    configs = pipeline_configs(str(smollm2), RANGES, host="127.0.0.1", ports=ports[:3],
                               extra={"cache_dir": str(slice_cache), "recovery_wait_s": 60, **STAGE_OPTIONS})
    for cfg, port in zip(configs, ports[4:7]):
        cfg["metrics_port"] = port
    stand_in = {**configs[draining], "stage_id": f"stage-{draining}b", "bind_addr": f"127.0.0.1:{ports[3]}",
                "metrics_port": ports[7]}
    configs[draining - 1]["downstream_alternates"] = [{"stage_id": stand_in["stage_id"], "stage_index": draining,
                                                      "endpoint": stand_in["bind_addr"]}]
    pipeline = LocalPipeline(configs, tmp_path, log_dir=tmp_path)
    standby = None
    try:
        pipeline.wait_serving(120)
        # started once the chain is up: an upstream takes a stand-in that is ready before its primary
        standby = LocalPipeline([stand_in], tmp_path, log_dir=tmp_path)
        standby.wait_serving(120)
        head = str(configs[0]["bind_addr"])
        other = "The three primary colours are"
        grpc_generate(head, other, 8)  # a resident prefix that must move too
        prompt = "Here is a short poem about the sea:\n"
        grpc_generate(head, prompt, 96, sampling=sampling)
        # the reference: a run that starts from the previous run's resident prefix, as the next one will
        undisturbed, _ = grpc_generate(head, prompt, 96, sampling=sampling)
        run = StreamingRun(head, prompt, 96, sampling=sampling)
        assert run.started.wait(60)
        pipeline.procs[draining].send_signal(signal.SIGTERM)
        run.worker.join(120)
        assert "error" not in run.outcome, run.outcome.get("error")
        assert "".join(run.pieces) == undisturbed
        assert pipeline.procs[draining].wait(30) == 0
        assert status(str(configs[draining - 1]["bind_addr"])).downstream_stage_id == stand_in["stage_id"]
        moved = metric(scrape(ports[7]), "skippy_sessions_moved_total", direction="imported")
        assert moved >= 2, "the live session and at least the other prompt's resident prefix"
        assert metric(scrape(ports[4]), "skippy_session_recoveries_total") == 0
        upstream_metrics = scrape(ports[4 + draining - 1])
        assert metric(upstream_metrics, "skippy_handoff_sessions_total", outcome="moved") == 1
        assert metric(upstream_metrics, "skippy_handoff_sessions_total", outcome="lost") == 0
        misses = metric(scrape(ports[4]), "skippy_prefix_cache_misses_total")
        _, again = grpc_generate(head, other, 8)
        assert again.cached_tokens > 0, "the moved prefix serves the next request"
        assert metric(scrape(ports[4]), "skippy_prefix_cache_misses_total") == misses
        assert_no_active_sessions([c for i, c in enumerate(configs) if i != draining] + [stand_in])
    finally:
        pipeline.stop()
        if standby is not None:
            standby.stop()
