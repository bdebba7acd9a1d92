"""The head's OpenAI-compatible HTTP API, checked with the official ``openai`` client.

Every test runs against real ``serve`` processes: SmolLM2 split 0:10 / 10:20 / 20:30 with
the API on the head. The contract:

* with temperature 0, /v1/chat/completions answers exactly what llama-cpp-python's
  ``create_chat_completion`` gives on the unsplit model (the GGUF's own chat template), and
  /v1/completions exactly what ``create_completion`` gives — text, finish_reason and usage;
* a stream's chunks concatenate to the non-streaming answer and end with ``data: [DONE]``;
* concurrent clients get what the same calls made one at a time get;
* refusals use OpenAI's error shape: 400 for bad input (naming the field), 429 with
  Retry-After when the lanes and the admission queue are full, 503 while a stage is down;
* a client that goes away stops its generation (its lane is freed for the next one).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import grpc
import numpy as np
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from skippy_stage.cli.local import free_ports
from skippy_stage.model.loader import reference_llama

RANGES = [(0, 10), (10, 20), (20, 30)]
MAX_TOKENS = 32
# One llama.cpp thread per stage: three stages share this machine's cores. Separate lanes
# (kv_unified off): concurrent clients must get what sequential calls get, which a shared
# KV pool does not promise (cells of concurrent sessions interleave; README, kv_unified).
STAGE_OPTIONS = {"n_threads": 1, "kv_unified": False}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sea salty?"}],
    [{"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Name another one."}],
]
PROMPTS = ["The capital of France is", "def add(a, b):"]
STOP_PROMPT, STOP = "Here is a short poem about the sea:\n", ["\n"]


def usage_of(result: dict) -> dict:
    return {k: result["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


@pytest.fixture(scope="module")
def reference(smollm2):
    """What llama-cpp-python answers on the unsplit model, greedy."""
    llm = reference_llama(smollm2, n_ctx=2048, verbose=False)
    try:
        chats = [llm.create_chat_completion(m, temperature=0, max_tokens=MAX_TOKENS) for m in CHATS]
        completions = [llm.create_completion(p, max_tokens=MAX_TOKENS, temperature=0) for p in PROMPTS]
        stopped = llm.create_completion(STOP_PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=STOP)
        echoed = llm.create_completion(PROMPTS[0], max_tokens=8, temperature=0, echo=True)
        return {"chats": chats, "completions": completions, "stopped": stopped, "echoed": echoed}
    finally:
        llm.close()


def start_api(start_pipeline, smollm2, **overrides):
    port = free_ports("127.0.0.1", 1)[0]
    pipeline = start_pipeline(smollm2, RANGES, http_port=[port, None, None], **STAGE_OPTIONS, **overrides)
    return pipeline, f"http://127.0.0.1:{port}/v1"


def client_for(base_url: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def api(smollm2, start_pipeline):
    pipeline, base_url = start_api(start_pipeline, smollm2)
    yield base_url
    pipeline.stop()


@pytest.fixture(scope="module")
def client(api):
    return client_for(api)


def raw_post(url: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """A POST without the openai client: status, headers, body."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def assert_error_shape(body: dict, error_type: str, param: str | None = None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == error_type
    if param is not None:
        assert error["param"] == param


def test_models_lists_the_gguf(client, smollm2):
    models = client.models.list()
    assert [m.id for m in models.data] == [smollm2.name]


def test_chat_greedy_equals_llama_cpp_create_chat_completion(client, reference, smollm2):
    for messages, expected in zip(CHATS, reference["chats"]):
        result = client.chat.completions.create(model=smollm2.name, messages=messages, temperature=0,
                                                max_tokens=MAX_TOKENS)
        choice = result.choices[0]
        assert choice.message.role == "assistant"
        assert choice.message.content == expected["choices"][0]["message"]["content"]
        assert choice.finish_reason == expected["choices"][0]["finish_reason"]
        assert result.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == \
            usage_of(expected)
        assert result.object == "chat.completion" and result.model == smollm2.name


def test_chat_stream_concatenates_to_the_non_streaming_answer(client, api):
    messages = CHATS[1]
    whole = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    chunks = list(client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in with_choices][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    counts = {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(include=counts) == whole.usage.model_dump(include=counts)
    # The same prompt again: all of it but the last token comes from the first call's resident prefix.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"

    body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": 4, "stream": True}).encode()
    status, headers, raw = raw_post(f"{api}/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.decode().split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_completions_greedy_equal_llama_cpp_create_completion(client, reference):
    for prompt, expected in zip(PROMPTS, reference["completions"]):
        result = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
        assert result.choices[0].text == expected["choices"][0]["text"]
        assert result.choices[0].finish_reason == expected["choices"][0]["finish_reason"]
        assert result.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == \
            usage_of(expected)

    expected = reference["stopped"]
    stream = client.completions.create(model="m", prompt=STOP_PROMPT, temperature=0, max_tokens=MAX_TOKENS,
                                       stop=STOP, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected["choices"][0]["text"]
    assert chunks[-1].choices[0].finish_reason == expected["choices"][0]["finish_reason"] == "stop"


def test_concurrent_clients_get_what_sequential_calls_get(start_pipeline, smollm2):
    """Without resident prefixes (cache_idle_slots 0): with them, how much of a prompt a request
    finds cached depends on what ran before it, and a shorter suffix prefill is another batch shape
    (README, resident prefixes), as with llama-cpp-python's own single-cache reuse."""
    pipeline, base_url = start_api(start_pipeline, smollm2, cache_idle_slots=0)
    client = client_for(base_url)
    calls = [("chat", m) for m in CHATS] + [("completion", p) for p in PROMPTS] + [("chat", CHATS[0])]

    def call(item: tuple[str, object]) -> str:
        kind, payload = item
        if kind == "chat":
            stream = client.chat.completions.create(model="m", messages=payload, temperature=0, max_tokens=24,
                                                    stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return client.completions.create(model="m", prompt=payload, temperature=0, max_tokens=24).choices[0].text

    try:
        sequential = [call(item) for item in calls]
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            concurrent = list(pool.map(call, calls))
    finally:
        pipeline.stop()
    assert concurrent == sequential
    assert len(set(sequential)) > 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": CHATS[0], "max_tokens": -1}, "max_tokens"),
        ({"messages": CHATS[0], "max_tokens": "8"}, "max_tokens"),
        ({"messages": CHATS[0], "max_tokens": 10**9}, "max_tokens"),
        ({"messages": CHATS[0], "temperature": -0.5}, "temperature"),
        ({"messages": CHATS[0], "top_p": 0}, "top_p"),
        ({"messages": CHATS[0], "seed": -3}, "seed"),
        ({"messages": CHATS[0], "stop": 7}, "stop"),
        ({"messages": CHATS[0], "stream": "yes"}, "stream"),
        ({"messages": CHATS[0], "n": 0}, "n"),
        ({"messages": CHATS[0], "presence_penalty": 3}, "presence_penalty"),
        ({"messages": CHATS[0], "logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": CHATS[0], "logit_bias": {"42": 101}}, "logit_bias"),
        ({"messages": CHATS[0], "logit_bias": {"49152": 1}}, "logit_bias"),  # past the vocabulary
        ({"messages": CHATS[0], "frequency_penalty": -2.5}, "frequency_penalty"),
        ({"messages": CHATS[0], "n": 5}, "n"),  # more choices than the pipeline's 4 lanes
    ],
)
def test_bad_chat_input_gets_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": "m", **body})
    err = caught.value
    assert err.status_code == 400
    assert_error_shape(err.response.json(), "invalid_request_error", param)
    assert param.split("[")[0].split(".")[0] in err.body["message"]


def test_bad_json_and_bad_prompts_get_400(api):
    for url, body in [
        (f"{api}/chat/completions", b"{not json"),
        (f"{api}/chat/completions", b"[1, 2]"),
        (f"{api}/chat/completions", json.dumps({"model": "m"}).encode()),
        (f"{api}/completions", json.dumps({"prompt": ""}).encode()),
        (f"{api}/completions", json.dumps({"prompt": {"text": "hi"}}).encode()),
        (f"{api}/completions", json.dumps({"prompt": "hi " * 3000, "max_tokens": 4}).encode()),
    ]:
        status, _, raw = raw_post(url, body)
        assert status == 400, raw
        assert_error_shape(json.loads(raw), "invalid_request_error")
    status, _, raw = raw_post(f"{api}/nothing-here", b"{}")
    assert status == 404
    assert_error_shape(json.loads(raw), "not_found_error")


def test_full_lanes_and_queue_get_429_and_a_closed_stream_frees_its_lane(smollm2, start_pipeline):
    # One lane, room for one waiting session: a running stream, one request waiting, and
    # the next one refused.
    pipeline, base_url = start_api(start_pipeline, smollm2, lane_count=1, admission_queue=1)
    try:
        client = client_for(base_url)
        running = client.completions.create(model="m", prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=1500,
                                            stream=True)
        first = next(iter(running))
        assert first.choices[0].text
        with ThreadPoolExecutor(max_workers=2) as pool:
            calls = [pool.submit(client.chat.completions.create, model="m", messages=CHATS[0], temperature=0,
                                 max_tokens=4) for _ in range(2)]
            done, _ = wait(calls, timeout=30, return_when=FIRST_COMPLETED)
            assert len(done) == 1, "neither of two requests beyond the queue was refused"
            refused = done.pop()
            err = refused.exception()
            assert isinstance(err, openai.RateLimitError), err
            assert err.status_code == 429
            assert int(err.response.headers["retry-after"]) >= 1
            assert_error_shape(err.response.json(), "rate_limit_error")
            assert "queue" in err.body["message"]

            # Closing the running stream must stop its generation (1500 tokens would take
            # far longer than this), so the waiting request gets the lane.
            started = time.monotonic()
            running.close()
            waiting = next(c for c in calls if c is not refused)
            answer = waiting.result(timeout=30)
            assert answer.choices[0].message.content
            assert time.monotonic() - started < 30
    finally:
        pipeline.stop()


def test_a_stage_down_gets_503(smollm2, start_pipeline):
    pipeline, base_url = start_api(start_pipeline, smollm2)
    try:
        client = client_for(base_url)
        assert client.chat.completions.create(model="m", messages=CHATS[0], max_tokens=2).choices
        os.kill(pipeline.procs[2].pid, signal.SIGKILL)
        pipeline.procs[2].wait(10)
        with grpc.insecure_channel(pipeline.head_endpoint) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 20
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "the head still reports SERVING with stage-2 killed"
                time.sleep(0.1)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as caught:
                client.chat.completions.create(model="m", messages=CHATS[0], max_tokens=4, stream=stream)
            err = caught.value
            assert err.status_code == 503
            assert "retry-after" in err.response.headers
            assert_error_shape(err.response.json(), "server_error")
            assert "not ready" in err.body["message"]
        assert [m.id for m in client.models.list().data] == [smollm2.name]  # the head itself still answers
    finally:
        pipeline.stop()


def http_get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_http_health_follows_the_chain_below_and_metrics_are_served_beside_it(smollm2, start_pipeline):
    """An operator who exposes only the HTTP port probes and scrapes it there: /health is the gRPC
    health service's truth (200 only while the chain answers, 503 with the reason), /metrics the
    stage's Prometheus registry."""
    pipeline, base_url = start_api(start_pipeline, smollm2)
    root = base_url.removesuffix("/v1")
    try:
        status, body = http_get(f"{root}/health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        client_for(base_url).completions.create(model="m", prompt="Hi", max_tokens=2)
        status, body = http_get(f"{root}/metrics")
        assert status == 200 and b'skippy_stage_info{stage_id="stage-0"} 1.0' in body
        assert b"skippy_lanes_active" in body and b"skippy_compute_seconds_count" in body
        os.kill(pipeline.procs[2].pid, signal.SIGKILL)
        pipeline.procs[2].wait(10)
        deadline = time.monotonic() + 20
        while (answer := http_get(f"{root}/health"))[0] == 200:
            assert time.monotonic() < deadline, "/health still 200 with stage-2 killed"
            time.sleep(0.1)
        status, body = answer
        assert status == 503 and "stage-2" in json.loads(body)["reason"]
        pipeline.restart(2)
        deadline = time.monotonic() + 90
        while http_get(f"{root}/health")[0] != 200:
            assert time.monotonic() < deadline, "/health not 200 again after stage-2 restarted"
            time.sleep(0.2)
    finally:
        pipeline.stop()


def test_with_an_auth_token_every_request_must_carry_it_as_the_api_key(smollm2, start_pipeline, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    pipeline, base_url = start_api(start_pipeline, smollm2, auth_token_path=str(token_file))
    try:
        for key in ("wrong", None):
            client = client_for(base_url)
            if key is None:
                client = client.with_options(default_headers={"Authorization": ""})
            else:
                client.api_key = key
            with pytest.raises(openai.AuthenticationError) as caught:
                client.models.list()
            assert caught.value.status_code == 401
            assert_error_shape(caught.value.response.json(), "invalid_request_error")
        client = openai.OpenAI(base_url=base_url, api_key="s3cret-token", max_retries=0, timeout=60)
        answer = client.chat.completions.create(model="m", messages=CHATS[0], temperature=0, max_tokens=4)
        assert answer.choices[0].message.content
        root = base_url.removesuffix("/v1")
        assert http_get(f"{root}/health")[0] == 200, "probes carry no token"
        assert http_get(f"{root}/metrics")[0] == 401
        assert http_get(f"{root}/metrics", "s3cret-token")[0] == 200
    finally:
        pipeline.stop()


def test_completion_logprobs_match_llama_cpp_pythons_own(smollm2, client):
    """``logprobs: N`` on completions: each token's log-probability and the N most likely tokens,
    from the full-vocabulary logits, as llama-cpp-python's ``create_completion(logprobs=N)`` gives
    them (its reference computes logits for every row; so does the pipeline when logprobs are asked)."""
    prompt = "The capital of France is"
    llm = reference_llama(smollm2, n_ctx=2048, verbose=False, logits_all=True)
    try:
        want = llm.create_completion(prompt, max_tokens=8, temperature=0, logprobs=3)["choices"][0]
    finally:
        llm.close()
    got = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0, logprobs=3).choices[0]
    assert got.text == want["text"]
    assert got.logprobs.tokens == want["logprobs"]["tokens"]
    assert got.logprobs.text_offset == want["logprobs"]["text_offset"]
    for mine, theirs in zip(got.logprobs.token_logprobs, want["logprobs"]["token_logprobs"]):
        assert abs(mine - theirs) < 1e-3
    for mine, theirs in zip(got.logprobs.top_logprobs, want["logprobs"]["top_logprobs"]):
        assert set(mine) == set(theirs)
        assert all(abs(mine[t] - theirs[t]) < 1e-3 for t in mine)


def test_chat_logprobs_give_each_token_its_bytes_and_top_alternatives(client):
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert "".join(c.token for c in content) == answer.choices[0].message.content
    for c in content:
        assert bytes(c.bytes).decode("utf-8", errors="ignore") == c.token
        assert len(c.top_logprobs) == 2 and c.logprob <= 0
        assert abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6, "greedy: the sampled token is the most likely"
    streamed = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hello."}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    tokens = [c.token for chunk in streamed for choice in chunk.choices if choice.logprobs
              for c in choice.logprobs.content]
    assert tokens == [c.token for c in content]


def test_echo_returns_the_prompt_before_the_completion_as_llama_cpp_python_does(client, reference):
    prompt = PROMPTS[0]
    expected = reference["echoed"]["choices"][0]
    assert expected["text"].startswith(prompt) and len(expected["text"]) > len(prompt)
    echoed = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert (echoed.choices[0].text, echoed.choices[0].finish_reason) == (expected["text"], expected["finish_reason"])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=prompt, max_tokens=8, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == echoed.choices[0].text


def test_echo_with_logprobs_gives_every_prompt_token_its_log_probability_given_the_tokens_before(smollm2, client):
    """OpenAI's echo + logprobs: the prompt's tokens come first, the first with null (nothing precedes
    it), each other with log P(token | the tokens before) and the N most likely tokens at its place,
    from the same full-vocabulary logits as a generated token's; then the completion's, as without
    echo, the text offsets counted from the prompt's start. The reference is llama-cpp-python's own
    logits for every row (``logits_all``): its ``create_completion(echo=True, logprobs=N)`` pairs row i
    with token i on a model without BOS, one place off, so the rows are aligned here."""
    prompt = "The capital of France is"
    llm = reference_llama(smollm2, n_ctx=2048, verbose=False, logits_all=True)
    try:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.eval(tokens)
        rows = [llm.logits_to_logprobs(row) for row in llm.scores[: len(tokens)]]
        best = [{llm.detokenize([int(t)]).decode("utf-8", errors="ignore") for t in np.argsort(-row)[:2]}
                for row in rows]
        plain = llm.create_completion(prompt, max_tokens=4, temperature=0, logprobs=2)["choices"][0]["logprobs"]
    finally:
        llm.close()
    got = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                    logprobs=2).choices[0]
    lp = got.logprobs
    n = len(tokens)
    assert "".join(lp.tokens[:n]) == prompt and got.text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        assert abs(lp.token_logprobs[i] - float(rows[i - 1][tokens[i]])) < 1e-3
        assert set(lp.top_logprobs[i]) == best[i - 1] | {lp.tokens[i]}
    assert lp.tokens[n:] == plain["tokens"]
    assert all(abs(a - b) < 1e-3 for a, b in zip(lp.token_logprobs[n:], plain["token_logprobs"]))
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:i])) for i in range(n)]
    assert lp.text_offset[n:] == plain["text_offset"]
    streamed = [c.choices[0] for c in client.completions.create(
        model="m", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2, stream=True) if c.choices]
    assert streamed[0].text == prompt
    assert sum((c.logprobs.tokens for c in streamed if c.logprobs), []) == lp.tokens
    assert sum((c.logprobs.text_offset for c in streamed if c.logprobs), []) == lp.text_offset


# -- n choices -------------------------------------------------------------------------

LONG_PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
               "The story should be set on a rocky island in the north, in winter.")


@pytest.fixture(scope="module")
def forking(smollm2, start_pipeline):
    """A pipeline whose every stage serves its metrics, to see where KV was copied."""
    metrics = free_ports("127.0.0.1", len(RANGES))
    pipeline, base_url = start_api(start_pipeline, smollm2, metrics_port=metrics)
    yield client_for(base_url), [f"http://127.0.0.1:{port}/metrics" for port in metrics], pipeline.head_endpoint
    pipeline.stop()


def scrape(url: str, name: str) -> float:
    """One unlabelled sample of a stage's Prometheus text."""
    _, body = http_get(url)
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in {url}")


def test_n_choices_with_a_seed_are_reproducible_and_their_prompt_is_prefilled_once(forking):
    """n=3 runs as three sessions: the first prefills the prompt, the other two start as copies of its
    KV on every stage (2 forks, 2 x (prompt - 1) tokens copied, per stage), and the batches carry far
    fewer tokens than three prefills would. Choice i samples with seed + i: the same request gives the
    same three texts, and they differ from each other."""
    client, metrics, _ = forking
    before = [(scrape(m, "skippy_session_forks_total"), scrape(m, "skippy_fork_tokens_copied_total"),
               scrape(m, "skippy_batch_tokens_sum")) for m in metrics]
    ask = dict(model="m", prompt=LONG_PROMPT, max_tokens=6, temperature=1.0, seed=1234, n=3)
    first = client.completions.create(**ask)
    after = [(scrape(m, "skippy_session_forks_total"), scrape(m, "skippy_fork_tokens_copied_total"),
              scrape(m, "skippy_batch_tokens_sum")) for m in metrics]
    prompt_tokens = first.usage.prompt_tokens
    assert [c.index for c in first.choices] == [0, 1, 2]
    for (forks0, copied0, fed0), (forks1, copied1, fed1) in zip(before, after):
        assert forks1 - forks0 == 2
        assert copied1 - copied0 == 2 * (prompt_tokens - 1)
        assert fed1 - fed0 <= prompt_tokens + 2 + first.usage.completion_tokens < 3 * prompt_tokens
    again = client.completions.create(**ask)
    texts = [c.text for c in first.choices]
    assert [c.text for c in again.choices] == texts
    assert len(set(texts)) > 1, texts
    assert first.usage.prompt_tokens == again.usage.prompt_tokens


def test_n_choices_stream_by_index_and_greedy_choices_agree(forking):
    """A stream's chunks name their choice; gathered by index they are the non-streaming texts.
    At temperature 0 every choice is the same text (their first tokens come from identical rows)."""
    client, _, _ = forking
    ask = dict(model="m", messages=CHATS[0], max_tokens=8, temperature=0.9, seed=7, n=2)
    whole = client.chat.completions.create(**ask)
    parts: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            parts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert [parts[0], parts[1]] == [c.message.content for c in whole.choices]
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    greedy = client.chat.completions.create(**{**ask, "temperature": 0, "n": 3})
    assert len({c.message.content for c in greedy.choices}) == 1


def test_grpc_generate_returns_each_tokens_logprobs_as_the_openai_api_does(forking):
    from skippy_stage.v1 import stage_pb2 as pb
    from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

    client, _, endpoint = forking
    prompt = "The capital of France is"
    want = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0, logprobs=2).choices[0]
    with grpc.insecure_channel(endpoint) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        messages = list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=6, top_logprobs=2,
                                                         sampling=pb.SamplingParams(temperature=0)), timeout=60))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=2, top_logprobs=21), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs=21" in refused.value.details()
    logprobs = [lp for m in messages for lp in m.logprobs]
    assert [lp.token for lp in logprobs] == [t for m in messages for t in m.token_ids]
    assert all(len(lp.top_tokens) == 2 for lp in logprobs)
    assert [round(lp.logprob, 4) for lp in logprobs] == [round(v, 4) for v in want.logprobs.token_logprobs]


def test_frequency_and_presence_penalties_reach_the_final_stages_sampler(client):
    """Accepted in OpenAI's range and applied (the arithmetic is pinned in the runtime's tests): a
    greedy completion that repeats its prompt's pattern goes elsewhere once repeats are penalised."""
    prompt = "one two one two one two one two one"
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    penalised = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                          frequency_penalty=1.5, presence_penalty=1.0).choices[0].text
    assert penalised != plain


def test_logit_bias_bans_or_forces_tokens_by_id(smollm2, client):
    llm = reference_llama(smollm2, n_ctx=256, verbose=False, vocab_only=True)
    try:
        paris, sea = (llm.tokenize(text.encode(), add_bos=False, special=False)[0] for text in (" Paris", " sea"))
    finally:
        llm.close()
    prompt = "The capital of France is"
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0).choices[0].text
    assert plain.startswith(" Paris")
    banned = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(paris): -100}).choices[0].text
    assert not banned.startswith(" Paris")
    forced = client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0,
                                       logit_bias={str(sea): 100}).choices[0].text
    assert forced == " sea" * 3


def test_a_response_read_whole_lets_the_head_hold_its_tokens_unless_stop_strings_must_be_seen():
    """Not streamed: nobody reads the tokens before the end, so the head holds them (its handler
    wakes about once a second, not once a token); streamed, or with stop strings (found only as
    tokens arrive), the head's own stream_interval_ms applies."""
    from skippy_stage.config import MAX_STREAM_INTERVAL_MS
    from skippy_stage.server.openai_api.request import parse_request

    def hold(**body):
        return parse_request({"prompt": "Hi", **body}, chat=False).spec(512).stream_interval_ms

    assert hold() == hold(stream=False) == MAX_STREAM_INTERVAL_MS
    assert hold(stream=True) is None
    assert hold(stop=["\n"]) is None
