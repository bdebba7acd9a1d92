"""Exactness for any schedule: a generation records the batches the pipeline ran
(``GenerateRequest.record_schedule``), and ``skippy-stage replay`` runs them on the unsplit model
in one process (llama-cpp-python's ``Llama``, loaded as the stages load): every sampled row's
logits must be bit-identical (a digest of the float32 row), the samples the same, and the tokens
the head sent the ones those samples give. A schedule that does not replay exactly fails, naming
its first step that differs.

Speculative (ngram) generations over 3 real stage processes, greedy and seeded, on loopback and
with every edge through the link emulator at 10 ms one-way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from skippy_stage.cli.local import LocalPipeline, free_ports, pipeline_configs, relay_links
from skippy_stage.errors import InvalidRequestError
from skippy_stage.model.loader import reference_llama
from skippy_stage.model.replay import replay
from skippy_stage.model.schedule import SAMPLE_VERIFY, Schedule
from skippy_stage.ops.link import Link
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

RANGES = [(0, 10), (10, 20), (20, 30)]
REPETITIVE = ("Repeat the following passage exactly.\n\nPassage: The old lighthouse keeper climbed the spiral "
              "stairs every evening, lit the great lamp, and watched the ships pass safely through the narrow "
              "strait. In winter the storms came early, and he kept the fire burning through the night, writing "
              "the names of the ships in a worn leather book.\n\nRepeated passage:")
FREE_FORM = "Once upon a time, in a small village by the mountains,"
MAX_TOKENS = 64
GREEDY = pb.SamplingParams(temperature=0.0)
SEEDED = pb.SamplingParams(temperature=0.8, top_k=40, seed=7)
SCRIPT = Path(sys.executable).parent / "skippy-stage"


def recorded(endpoint: str, prompt: str, sampling: pb.SamplingParams, *, k: int | str = 4) -> tuple[str, Schedule]:
    speculative = pb.Speculative(drafter="ngram", k=8, adaptive=True) if k == "auto" else \
        pb.Speculative(drafter="ngram", k=k)
    request = pb.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, sampling=sampling, record_schedule=True,
                                 speculative=speculative)
    with grpc.insecure_channel(endpoint) as channel:
        messages = list(pb_grpc.StageServiceStub(channel).Generate(request, timeout=300))
    assert messages[-1].done and messages[-1].schedule_json
    return "".join(m.text for m in messages), Schedule.from_json(messages[-1].schedule_json)


def start(model: Path, workdir: Path, cache: Path, delay_ms: float) -> LocalPipeline:
    configs = pipeline_configs(str(model), RANGES, host="127.0.0.1", ports=free_ports("127.0.0.1", 3),
                               extra={"cache_dir": str(cache), "ctx_size": 4 * 1024, "lane_count": 4,
                                      "n_threads": max(1, (os.cpu_count() or 1) // 3), "kv_unified": False},
                               return_path="direct")
    configs[0]["speculative"] = {"drafter": "ngram", "k": 4}
    links = relay_links(configs, Link.from_ms(delay_ms)) if delay_ms else None
    pipeline = LocalPipeline(configs, workdir, links=links)
    try:
        pipeline.wait_serving(180)
    except BaseException:
        pipeline.stop()
        raise
    return pipeline


@pytest.fixture(scope="module", params=[0, 10], ids=["loopback", "10ms-links"])
def schedules(request, smollm2, slice_cache, tmp_path_factory):
    """Each delay's pipeline, and the schedules of its generations: (name -> (text, schedule))."""
    pipeline = start(smollm2, tmp_path_factory.mktemp("pipeline"), slice_cache, request.param)
    try:
        # (the first generation teaches the head what a trip costs: windows go in flight from then on)
        recorded(pipeline.head_endpoint, FREE_FORM, GREEDY)
        runs = {
            "greedy-repetitive": recorded(pipeline.head_endpoint, REPETITIVE, GREEDY),
            "greedy-free-form": recorded(pipeline.head_endpoint, FREE_FORM, GREEDY),
            "seeded-repetitive": recorded(pipeline.head_endpoint, REPETITIVE, SEEDED),
            "seeded-free-form": recorded(pipeline.head_endpoint, FREE_FORM, SEEDED, k="auto"),
        }
    finally:
        pipeline.stop()
    return runs


@pytest.mark.parametrize("name", ["greedy-repetitive", "greedy-free-form", "seeded-repetitive", "seeded-free-form"])
def test_a_speculative_generation_replays_exactly_on_the_unsplit_model(schedules, smollm2, name):
    text, schedule = schedules[name]
    verified = [s for s in schedule.steps if s.sample == SAMPLE_VERIFY]
    assert verified, "the generation speculated"
    assert schedule.completion and all(s.digests for s in schedule.steps if s.samples)
    report = replay(schedule, smollm2)
    assert report.exact, report.mismatch
    assert report.rows == sum(len(s.samples) for s in schedule.steps)
    assert report.tokens == len(schedule.completion)


def prompt_lookup(model: Path, prompts: list[str], k: int = 4) -> list[str]:
    """llama-cpp-python's own prompt-lookup speculation on the unsplit model, greedy."""
    llm = reference_llama(model, n_ctx=2048, verbose=False,
                          draft_model=LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=k))
    try:
        return [llm.create_completion(p, max_tokens=MAX_TOKENS, temperature=0)["choices"][0]["text"] for p in prompts]
    finally:
        llm.close()


def test_greedy_text_is_llama_cpp_pythons_prompt_lookup_and_over_10ms_links_windows_go_in_flight(
        schedules, smollm2, request):
    # A chained window that comes back whole is the window the head would have sent next, so with a
    # fixed k the batches are the reference's; stale windows' rows are rewound before the next.
    if "10ms" in request.node.callspec.id:
        chained = [s for _, schedule in schedules.values() for s in schedule.steps if s.continues]
        assert chained, "no window was sent behind another"
    expected = prompt_lookup(smollm2, [REPETITIVE, FREE_FORM])
    assert [schedules["greedy-repetitive"][0], schedules["greedy-free-form"][0]] == expected


def tamper(schedule: Schedule, how: str) -> tuple[Schedule, int]:
    """A copy of ``schedule`` changed at one step; that step's index."""
    copy = Schedule.from_json(schedule.to_json())
    verify = next(s for s in copy.steps if s.sample == SAMPLE_VERIFY and len(s.samples) > 1)
    if how == "logits":
        verify.digests[1] = f"{int(verify.digests[1], 16) ^ 1:016x}"
    elif how == "sample":
        verify.samples[0] += 1
    elif how == "emitted":
        verify.emitted[-1] += 1
        copy.completion = [t for s in copy.steps for t in s.emitted]
    elif how == "position":
        verify.start += 1
    return copy, verify.index


@pytest.mark.parametrize("how", ["logits", "sample", "emitted", "position"])
def test_a_schedule_that_does_not_replay_exactly_fails_naming_its_step(schedules, smollm2, how):
    _, schedule = schedules["greedy-repetitive"]
    bad, index = tamper(schedule, how)
    report = replay(bad, smollm2)
    assert not report.exact
    assert report.mismatch.step == index, report.mismatch


def test_the_replay_command_exits_0_when_exact_and_1_naming_the_step_that_differs(schedules, smollm2, tmp_path):
    _, schedule = schedules["seeded-repetitive"]
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(schedule.to_json())
    tampered, index = tamper(schedule, "logits")
    bad.write_text(tampered.to_json())
    env = {**os.environ}
    env.pop("PYTHONPATH", None)
    ok = subprocess.run([str(SCRIPT), "replay", str(good), "--model", str(smollm2)], capture_output=True, text=True,
                        timeout=300, env=env)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    assert "verdict: exact" in ok.stdout
    differs = subprocess.run([str(SCRIPT), "replay", str(bad), "--model", str(smollm2), "--json"],
                             capture_output=True, text=True, timeout=300, env=env)
    assert differs.returncode == 1, differs.stderr + differs.stdout
    assert json.loads(differs.stdout)["mismatch"]["step"] == index


def test_a_document_that_is_not_a_schedule_is_refused_by_what_is_wrong():
    for text, words in (("[]", "JSON object"), ('{"version": 99}', "version=99"), ("{", "not JSON"),
                        ('{"version": 1, "model": "m"}', "schedule:")):
        with pytest.raises(InvalidRequestError, match=words):
            Schedule.from_json(text)
