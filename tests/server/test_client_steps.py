"""A gRPC client driving a head step by step with ``IterationBatch``: token ids in, the final
stage's sampled token (and logits) out, as llama-cpp-python's ``Llama.eval`` gives them for the
unsplit model.

One session, prefill then one decode step per token, is the reference's own batch shapes (the
prompt in one batch with its last row an output, then one token per batch): the greedy tokens
are equal and so are the logits, bit for bit. Two sessions stepped together in one request
(separate lanes) each get their own session's tokens.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import llama_cpp
import numpy as np
import pytest
from support.pipeline import assert_no_active_sessions

from skippy_stage.model.loader import reference_llama
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

RANGES = [(0, 15), (15, 30)]
STEPS = 12
PROMPTS = ["The capital of France is", "def add(a, b):"]
RPC_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def pipeline(smollm2, start_pipeline):
    pipeline = start_pipeline(smollm2, RANGES, n_threads=1)
    yield pipeline
    pipeline.stop()


@pytest.fixture(scope="module")
def head(pipeline) -> Iterator[pb_grpc.StageServiceStub]:
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        yield pb_grpc.StageServiceStub(channel)


@pytest.fixture(scope="module")
def llm(smollm2):
    llm = reference_llama(smollm2, n_ctx=2048, verbose=False)  # a lane's 2048 cells
    yield llm
    llm.close()


def reference_steps(llm, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and each step's logits from ``Llama.eval``: the prompt, then one token a batch
    (each batch's last row is its one output row: ``llama_get_logits_ith(ctx, -1)``)."""
    llm.reset()
    llm.eval(prompt)
    tokens, logits = [], []
    for _ in range(steps):
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
        logits.append(row)
        tokens.append(int(np.argmax(row)))  # llama.cpp's greedy sampler: the first largest logit
        llm.eval([tokens[-1]])
    return tokens, logits


def entry(session_id: str, start: int, token_ids: list[int], *, want_logits: bool) -> pb.BatchEntry:
    return pb.BatchEntry(session_id=session_id, phase=pb.PHASE_PREFILL if start == 0 else pb.PHASE_DECODE,
                         positions=list(range(start, start + len(token_ids))), token_ids=token_ids,
                         sample_last=True, want_logits=want_logits, sampling=pb.SamplingParams(temperature=0.0))


def step(head: pb_grpc.StageServiceStub, *entries: pb.BatchEntry) -> dict[str, pb.EntryOutput]:
    response = head.IterationBatch(pb.IterationBatchRequest(request_id=uuid.uuid4().hex, entries=entries),
                                   timeout=RPC_TIMEOUT_S)
    assert response.final_stage_id == "stage-1"
    outputs = {o.session_id: o for o in response.outputs}
    assert sorted(outputs) == sorted(e.session_id for e in entries)
    assert all(o.has_token for o in outputs.values())
    return outputs


def test_prefill_then_decode_steps_give_llama_cpp_pythons_greedy_tokens_and_logits_bit_for_bit(head, llm, pipeline):
    prompt = llm.tokenize(PROMPTS[0].encode())
    want_tokens, want_logits = reference_steps(llm, prompt, STEPS)
    session = f"steps-{uuid.uuid4().hex[:8]}"

    tokens, worst = [], []
    try:
        fed, position = prompt, 0
        for _ in range(STEPS):
            out = step(head, entry(session, position, fed, want_logits=True))[session]
            logits = np.array(out.logits, dtype=np.float32)
            assert logits.shape == want_logits[len(tokens)].shape
            worst.append(float(np.max(np.abs(logits - want_logits[len(tokens)]))))
            tokens.append(out.token)
            position += len(fed)
            fed = [out.token]
    finally:
        head.DropSession(pb.DropSessionRequest(session_id=session), timeout=RPC_TIMEOUT_S)

    assert tokens == want_tokens
    assert max(worst) == 0.0, f"max |logit diff| per step: {worst}"
    assert_no_active_sessions(pipeline.configs)


def test_two_sessions_stepped_together_each_get_their_own_greedy_tokens(head, llm, pipeline):
    prompts = [llm.tokenize(p.encode()) for p in PROMPTS]
    want = [reference_steps(llm, p, STEPS)[0] for p in prompts]
    sessions = [f"pair-{i}-{uuid.uuid4().hex[:8]}" for i in range(2)]

    got: list[list[int]] = [[], []]
    try:
        fed, positions = list(prompts), [0, 0]
        for _ in range(STEPS):
            outputs = step(head, *(entry(s, positions[i], fed[i], want_logits=False) for i, s in enumerate(sessions)))
            for i, s in enumerate(sessions):
                got[i].append(outputs[s].token)
                positions[i] += len(fed[i])
                fed[i] = [outputs[s].token]
    finally:
        for s in sessions:
            head.DropSession(pb.DropSessionRequest(session_id=s), timeout=RPC_TIMEOUT_S)

    assert got == want
    assert want[0] != want[1]
    assert_no_active_sessions(pipeline.configs)
