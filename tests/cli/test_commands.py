"""The commands a user runs, run as the user runs them (the console script, real ``serve``
processes), each checked against llama-cpp-python on the unsplit model (``reference_llama``,
loaded as the stages load).

- ``demo`` prints the unsplit model's greedy chat answer to its own prompt and exits 0.
- ``slice`` writes stage files that ``serve`` loads as they are (``load_mode: artifact-slice``),
  and the pipeline they make completes as the unsplit model does.
- ``generate --chat``, ``--seed S --temperature T``, ``--token-file`` and ``--tls-ca/--tls-cert/
  --tls-key``: against a pipeline that wants mutual TLS and a token, the chat answer is
  ``create_chat_completion``'s and the seeded text is ``create_completion(seed=S)``'s with the same
  sampler chain; a missing token is one line naming UNAUTHENTICATED.
- ``up --layers A:B,B:C --http-port P`` serves exactly those layer ranges, the gRPC head and the
  OpenAI API give the unsplit model's text, and SIGTERM stops every stage and exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import openai
import pytest
from support.chat import reference_chat
from support.pipeline import PROMPTS, reference_texts
from support.pki import write_pki
from support.up import SCRIPT

from skippy_stage.cli.commands import DEMO_PROMPT
from skippy_stage.cli.local import LocalPipeline, free_ports, pipeline_configs
from skippy_stage.model.loader import reference_llama
from skippy_stage.model.slicing import slice_metadata
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

TOKEN = "a-users-token"
MAX_TOKENS = 16
DEMO_MAX_TOKENS = 64  # demo's --max-tokens default
CHAT = "Name three colours of the rainbow."
SEEDED_PROMPT = "Once upon a time"
SEED, TEMPERATURE = 1234, 1.0


def skippy(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    assert SCRIPT.exists(), f"the console script is not installed beside {sys.executable}"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env or os.environ.copy(), stdin=subprocess.DEVNULL)


def cache_env(slice_cache: Path) -> dict[str, str]:
    return {**os.environ, "SKIPPY_STAGE_CACHE": str(slice_cache)}


def status(endpoint: str) -> pb.StageStatus:
    with grpc.insecure_channel(endpoint) as channel:
        return pb_grpc.StageServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)


# -- demo ------------------------------------------------------------------------------------------


def test_demo_prints_the_unsplit_models_chat_answer_to_its_prompt_and_exits_0(smollm2, slice_cache):
    [answer] = reference_chat(smollm2, [DEMO_PROMPT], DEMO_MAX_TOKENS)

    done = skippy("demo", env=cache_env(slice_cache))

    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == f"> {DEMO_PROMPT}\n{answer}\n"
    assert "Paris" in answer  # the demo's point: a real answer, not just the same bytes
    lines = done.stderr.splitlines()
    assert lines[0].startswith("# native capture and frame path loaded"), lines[0]
    assert any(line.startswith("# 3-stage SmolLM2-135M pipeline up in") for line in lines), done.stderr[-3000:]
    assert "Traceback" not in done.stderr


# -- slice, then serve the stage files as they are ---------------------------------------------------


def test_stage_files_from_slice_served_as_artifact_slices_complete_as_the_unsplit_model(
        smollm2, slice_cache, tmp_path):
    """Stage 0 is written where ``--out`` says, the final stage into the cache (``slice`` prints
    its path): ``serve`` loads both as they are, slicing nothing itself (its cache stays empty)."""
    head_file = tmp_path / "head.gguf"
    made = skippy("slice", str(smollm2), "--layers", "0:15", "--out", str(head_file), env=cache_env(slice_cache))
    assert made.returncode == 0, made.stderr[-3000:]
    assert made.stdout.strip() == str(head_file)
    made = skippy("slice", str(smollm2), "--layers", "15:30", env=cache_env(slice_cache))
    assert made.returncode == 0, made.stderr[-3000:]
    final_file = Path(made.stdout.strip())
    assert final_file.is_file() and final_file.is_relative_to(slice_cache), final_file
    assert {k: slice_metadata(head_file)[k] for k in ("layer_start", "layer_end", "final")} == \
        {"layer_start": 0, "layer_end": 15, "final": False}
    assert {k: slice_metadata(final_file)[k] for k in ("layer_start", "layer_end", "final")} == \
        {"layer_start": 15, "layer_end": 30, "final": True}

    unused_cache = tmp_path / "serve-cache"
    unused_cache.mkdir()
    configs = pipeline_configs(str(smollm2), [(0, 15), (15, 30)], host="127.0.0.1",
                               ports=free_ports("127.0.0.1", 2),
                               extra={"load_mode": "artifact-slice", "cache_dir": str(unused_cache), "n_threads": 1,
                                      "ctx_size": 2048, "lane_count": 1})
    configs[0]["model_path"], configs[1]["model_path"] = str(head_file), str(final_file)
    pipeline = LocalPipeline(configs, tmp_path)
    try:
        pipeline.wait_serving(180)
        texts = [skippy("generate", "--endpoint", pipeline.head_endpoint, "--max-tokens", str(MAX_TOKENS), p)
                 for p in PROMPTS[:2]]
        assert [t.returncode for t in texts] == [0, 0], [t.stderr[-2000:] for t in texts]
        assert [t.stdout for t in texts] == reference_texts(smollm2, PROMPTS[:2], MAX_TOKENS)
        head, final = status(str(configs[0]["bind_addr"])), status(str(configs[1]["bind_addr"]))
        assert (head.layer_start, head.layer_end, final.layer_start, final.layer_end) == (0, 15, 15, 30)
        assert list(unused_cache.iterdir()) == []
    finally:
        pipeline.stop()


# -- generate's flags, against a pipeline that wants mutual TLS and a token ------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return write_pki(tmp_path_factory.mktemp("pki"), TOKEN)


@pytest.fixture(scope="module")
def secure_head(smollm2, start_pipeline, pki) -> str:
    _, paths = pki
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, tls_cert_path=paths["stage_cert"],
                              tls_key_path=paths["stage_key"], tls_ca_path=paths["ca"],
                              auth_token_path=paths["token"])
    yield pipeline.head_endpoint
    pipeline.stop()


def secure_generate(endpoint: str, paths: dict[str, str], *args: str, token: bool = True) -> subprocess.CompletedProcess:
    tls = ["--tls-ca", paths["ca"], "--tls-cert", paths["client_cert"], "--tls-key", paths["client_key"]]
    return skippy("generate", "--endpoint", endpoint, *tls, *(["--token-file", paths["token"]] if token else []), *args)


def test_generate_chat_over_mutual_tls_with_a_token_prints_the_unsplit_models_chat_answer(smollm2, secure_head, pki):
    _, paths = pki
    [answer] = reference_chat(smollm2, [CHAT], MAX_TOKENS)

    done = secure_generate(secure_head, paths, "--chat", "--max-tokens", str(MAX_TOKENS), CHAT)

    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == answer


def test_generate_with_a_seed_and_a_temperature_prints_llama_cpp_pythons_text_for_that_seed(smollm2, secure_head, pki):
    """``--seed S --temperature T`` and no other sampling flag is llama.cpp's chain with top-k,
    top-p and min-p off and no penalty, drawing from ``dist(S)``: ``create_completion`` with the
    same seed and those settings samples the same text. It is not the greedy text, so the seed
    and the temperature both reached the final stage's sampler."""
    _, paths = pki
    llm = reference_llama(smollm2, n_ctx=2048, verbose=False)
    try:
        seeded = llm.create_completion(SEEDED_PROMPT, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=SEED,
                                       top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)["choices"][0]["text"]
        greedy = llm.create_completion(SEEDED_PROMPT, max_tokens=MAX_TOKENS, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()
    assert seeded != greedy

    done = secure_generate(secure_head, paths, "--seed", str(SEED), "--temperature", str(TEMPERATURE),
                           "--max-tokens", str(MAX_TOKENS), SEEDED_PROMPT)

    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == seeded


def test_generate_without_the_token_fails_in_one_line_naming_unauthenticated(secure_head, pki):
    _, paths = pki

    done = secure_generate(secure_head, paths, "--max-tokens", "4", PROMPTS[0], token=False)

    assert done.returncode == 2
    assert done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("skippy-stage generate: error: Generate failed: UNAUTHENTICATED"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


# -- up --layers --http-port ---------------------------------------------------------------------


def test_up_with_layers_and_an_http_port_serves_those_ranges_and_the_unsplit_models_text(
        smollm2, slice_cache, tmp_path):
    http = free_ports("127.0.0.1", 1)[0]
    log = tmp_path / "up.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen([str(SCRIPT), "--log-level", "warning", "up", "--model", str(smollm2),
                                 "--layers", "0:7,7:30", "--http-port", str(http), "--ctx-size", "4096"],
                                stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True,
                                env=cache_env(slice_cache))
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint, f"up exited with {proc.wait()} before printing the head endpoint: {log.read_text()}"
        head = status(endpoint)
        final = status(head.downstream_endpoint)
        assert (head.layer_start, head.layer_end, head.include_embeddings) == (0, 7, True)
        assert (final.layer_start, final.layer_end, final.include_output, final.downstream_endpoint) == (7, 30, True, "")
        assert f"# OpenAI-compatible API at http://127.0.0.1:{http}/v1" in log.read_text()

        expected = reference_texts(smollm2, PROMPTS[:2], MAX_TOKENS)
        over_grpc = skippy("generate", "--endpoint", endpoint, "--max-tokens", str(MAX_TOKENS), PROMPTS[0])
        assert over_grpc.returncode == 0, over_grpc.stderr[-2000:]
        assert over_grpc.stdout == expected[0]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=120)
        over_http = client.completions.create(model=smollm2.name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                              temperature=0).choices[0].text
        assert over_http == expected[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log.read_text()[-3000:]
    for stage in (endpoint, head.downstream_endpoint):  # every stage went with it
        with grpc.insecure_channel(stage) as channel, pytest.raises(grpc.RpcError) as gone:
            pb_grpc.StageServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=5)
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
