"""The product, checked from outside: separate ``serve`` processes chained over gRPC.

The contract: with temperature 0 (and no chat template), the text ``skippy-stage
generate`` prints equals llama-cpp-python's ``create_completion`` on the unsplit model,
for every split and every accepted architecture. Concurrent sessions never leak into each
other, and a stage killed mid-generation makes ``Generate`` fail fast with UNAVAILABLE
naming it, while the surviving stages free the session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from support.pipeline import PROMPTS, StreamingRun, assert_no_active_sessions, grpc_generate, reference_texts, status

from skippy_stage.model import threadpool
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

MAX_TOKENS = 48


def cli_generate(endpoint: str, prompt: str, max_tokens: int) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "skippy_stage", "generate", "--endpoint", endpoint, "--max-tokens", str(max_tokens),
         "--temperature", "0", prompt],
        capture_output=True, text=True, timeout=300, check=True,
    )
    return out.stdout


@pytest.fixture(scope="module")
def smollm2_texts(smollm2):
    return reference_texts(smollm2, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("ranges, transport", [
    ([(0, 15), (15, 30)], "tcp"), ([(0, 10), (10, 20), (20, 30)], "tcp"), ([(0, 10), (10, 20), (20, 30)], "stream"),
], ids=["2-stage", "3-stage", "3-stage-over-the-grpc-stream"])
def test_generate_prints_exactly_what_the_unsplit_model_completes(ranges, transport, smollm2, smollm2_texts,
                                                                   start_pipeline):
    pipeline = start_pipeline(smollm2, ranges, hop_transport=transport)
    try:
        for prompt, expected in zip(PROMPTS, smollm2_texts):
            assert cli_generate(pipeline.head_endpoint, prompt, MAX_TOKENS) == expected
        assert_no_active_sessions(pipeline.configs)
    finally:
        pipeline.stop()


def _threads_cores(pid: int) -> dict[int, set[int]]:
    """Each thread of ``pid`` and the cores it may run on."""
    cores = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        allowed = next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
        cores[int(task.name)] = {c for part in allowed.split(",") for c in _span(part)}
    return cores


def _span(part: str) -> range:
    first, _, last = part.partition("-")
    return range(int(first), int(last or first) + 1)


@pytest.mark.skipif(not threadpool.openmp_build(), reason="OpenMP's binding: a llama.cpp built without OpenMP "
                    "decodes on ggml pools whose threads are not bound")
@pytest.mark.parametrize("every_core", [False, True], ids=["cores-shared-out", "every-core-each"])
def test_stages_sharing_a_host_start_their_threads_on_different_cores(every_core, smollm2, smollm2_texts,
                                                                      start_pipeline, monkeypatch):
    """Stage i binds from the (i mod n)-th core on: its main thread and every thread it started
    (gRPC's, the frame listener's, the one that decodes) run there, OpenMP's workers on the
    others, so neighbours run their Python on different cores; the text stays the unsplit model's."""
    for name in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    extra = {"n_threads": len(os.sched_getaffinity(0))} if every_core else {}  # as `up` gives them
    pipeline = start_pipeline(smollm2, [(0, 10), (10, 20), (20, 30)], **extra)
    try:
        assert cli_generate(pipeline.head_endpoint, PROMPTS[0], MAX_TOKENS) == smollm2_texts[0]
        cores = sorted(os.sched_getaffinity(0))
        for i, (cfg, proc) in enumerate(zip(pipeline.configs, pipeline.procs)):
            n_threads = int(cfg["n_threads"])
            # one core apart when each takes every core, n_threads apart (side by side) otherwise
            home = cores[i * (n_threads if n_threads < len(cores) else 1) % len(cores)]
            threads = _threads_cores(proc.pid)
            assert threads[proc.pid] == {home}, f"stage {i}'s main thread may run on {threads[proc.pid]}, not core {home}"
            elsewhere = [tid for tid, allowed in threads.items() if allowed != {home}]
            # OpenMP's workers (n_threads - 1 of them), each bound to another core of its own
            assert len(elsewhere) <= n_threads - 1, f"stage {i}: threads off core {home}: {threads}"
            assert all(len(threads[tid]) == 1 and home not in threads[tid] for tid in elsewhere), threads
    finally:
        pipeline.stop()


def test_gemma3_pipeline_prints_exactly_what_the_unsplit_model_completes(gemma3, start_pipeline):
    prompts = PROMPTS[:2]
    expected = reference_texts(gemma3, prompts, 24)
    pipeline = start_pipeline(gemma3, [(0, 5), (5, 11), (11, 18)])
    try:
        for prompt, text in zip(prompts, expected):
            assert cli_generate(pipeline.head_endpoint, prompt, 24) == text
    finally:
        pipeline.stop()


def test_eight_concurrent_generations_equal_the_same_calls_made_one_at_a_time(smollm2, start_pipeline):
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 3)][:8]
    # Separate lanes: with a shared KV pool concurrent sessions' cells interleave and the text
    # may depend on the company a request keeps (README, kv_unified); lanes promise it does not.
    # No resident prefixes: with them how much of a prompt is cached depends on what ran before
    # (here "The capital of France is 6" finds "... 0" and "... 3" sequentially, not concurrently),
    # and a shorter suffix prefill is another batch shape (README, resident prefixes; seen on an
    # AVX-512 Xeon: the 7th text differed after "12,000").
    pipeline = start_pipeline(smollm2, [(0, 10), (10, 20), (20, 30)], lane_count=8, kv_unified=False,
                              cache_idle_slots=0)
    try:
        sequential = [grpc_generate(pipeline.head_endpoint, p, 24)[0] for p in prompts]
        with ThreadPoolExecutor(max_workers=8) as pool:
            concurrent = list(pool.map(lambda p: grpc_generate(pipeline.head_endpoint, p, 24)[0], prompts))
        assert concurrent == sequential
        assert len(set(sequential)) > 1
        assert_no_active_sessions(pipeline.configs)
    finally:
        pipeline.stop()


@pytest.mark.parametrize("transport", ["tcp", "stream"])
def test_killing_a_downstream_stage_fails_generate_fast_and_frees_the_session_upstream(smollm2, start_pipeline,
                                                                                      transport):
    pipeline = start_pipeline(smollm2, [(0, 10), (10, 20), (20, 30)], recovery_wait_s=0, hop_transport=transport)
    try:
        head = pipeline.head_endpoint
        first_piece = threading.Event()
        outcome: dict[str, object] = {}

        def run() -> None:
            with grpc.insecure_channel(head) as channel:
                stub = pb_grpc.StageServiceStub(channel)
                try:
                    for msg in stub.Generate(pb.GenerateRequest(prompt=PROMPTS[1], max_tokens=400), timeout=30):
                        if msg.text:
                            first_piece.set()
                    outcome["finished"] = True
                except grpc.RpcError as err:
                    outcome["error"] = err
                    outcome["at"] = time.monotonic()
                first_piece.set()

        worker = threading.Thread(target=run)
        worker.start()
        assert first_piece.wait(60)
        killed_at = time.monotonic()
        os.kill(pipeline.procs[2].pid, signal.SIGKILL)
        worker.join(30)
        assert not worker.is_alive(), "Generate hung after a stage was killed"
        err = outcome.get("error")
        assert isinstance(err, grpc.RpcError), f"Generate did not fail: {outcome}"
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "stage-2" in err.details()
        print(f"kill -9 of stage-2 to the client's UNAVAILABLE over {transport}: "
              f"{(outcome['at'] - killed_at) * 1e3:.0f} ms")
        assert_no_active_sessions(pipeline.configs[:2])
        # Restarted, it serves again with no operator action anywhere else.
        pipeline.procs[2].wait()
        pipeline.restart(2)
        deadline = time.monotonic() + 60
        while True:  # health travels up the chain within a second or two of the restart
            try:
                text, last = grpc_generate(head, PROMPTS[0], 8)
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, err
                time.sleep(0.3)
        assert last.done and text
    finally:
        pipeline.stop()


def test_a_stage_killed_and_restarted_mid_generation_is_recovered_with_identical_text(smollm2, start_pipeline):
    """The head keeps each session's tokens; once the chain answers again it re-prefills
    them through it and goes on, so a greedy generation ends exactly as an undisturbed one."""
    pipeline = start_pipeline(smollm2, [(0, 10), (10, 20), (20, 30)], n_threads=1, recovery_wait_s=60)
    try:
        prompt = "Here is a short poem about the sea:\n"
        undisturbed, _ = grpc_generate(pipeline.head_endpoint, prompt, 64)
        run = StreamingRun(pipeline.head_endpoint, prompt, 64)
        assert run.started.wait(60)
        os.kill(pipeline.procs[1].pid, signal.SIGKILL)
        pipeline.procs[1].wait()
        killed_at = time.monotonic()
        pipeline.restart(1)
        run.worker.join(120)
        assert "error" not in run.outcome, run.outcome.get("error")
        print(f"recovered {time.monotonic() - killed_at:.1f}s after the kill (restart included)")
        assert "".join(run.pieces) == undisturbed
        assert run.outcome["done"].completion_tokens == 64
        assert_no_active_sessions(pipeline.configs)
    finally:
        pipeline.stop()


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_killed_stage_is_replaced_by_a_configured_alternate_and_the_text_is_unchanged(
        smollm2, slice_cache, tmp_path, seeded):
    """stage-1 lists stage-2b (same layers 20:30) as an alternate: when stage-2 dies, stage-1
    switches to it, the head re-prefills its session through the new chain and goes on. Seeded at
    temperature > 0 too: the new final stage's sampler skips the draws the dead one made."""
    sampling = pb.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=99) if seeded else None
    from skippy_stage.cli.local import LocalPipeline, free_ports, pipeline_configs

    ports = free_ports("127.0.0.1", 4)
    configs = pipeline_configs(str(smollm2), [(0, 10), (10, 20), (20, 30)], host="127.0.0.1", ports=ports[:3],
                               extra={"cache_dir": str(slice_cache), "n_threads": 1, "recovery_wait_s": 60})
    alternate = {**configs[2], "stage_id": "stage-2b", "bind_addr": f"127.0.0.1:{ports[3]}"}
    configs[1]["downstream_alternates"] = [{"stage_id": "stage-2b", "stage_index": 2,
                                            "endpoint": alternate["bind_addr"]}]
    pipeline = LocalPipeline([*configs, alternate], tmp_path)
    try:
        pipeline.wait_serving(120)
        prompt = "Here is a short poem about the sea:\n"
        undisturbed, _ = grpc_generate(pipeline.head_endpoint, prompt, 64, sampling=sampling)
        run = StreamingRun(pipeline.head_endpoint, prompt, 64, sampling=sampling)
        assert run.started.wait(60)
        os.kill(pipeline.procs[2].pid, signal.SIGKILL)
        run.worker.join(120)
        assert "error" not in run.outcome, run.outcome.get("error")
        assert "".join(run.pieces) == undisturbed
        assert status(str(configs[1]["bind_addr"])).downstream_stage_id == "stage-2b"
        assert_no_active_sessions([configs[0], configs[1], alternate])
    finally:
        pipeline.stop()
