"""The plain way: a frame that asks a stage for its layers and nothing else runs without a step.

Most frames of a generation ask only that, and on the general path a stage turns each into a
step, the step into runtime entries, and its results back into a step and a message: ~110 us
per frame on the caches a decode has just emptied. ``codec.plain_frame`` reads such a frame
straight into runtime entries and ``codec.forward_plain`` sends the message it came in with this
stage's rows. So the contract is equivalence: the same entries, the same message on, the same
answer to a refusal as the general path; and whatever is more than plain, or wrong, declines to
the general path (which names what is wrong) without anything changed.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from support.chain import split_configs

from skippy_stage.model.runtime import BatchEntry, EntryResult
from skippy_stage.model.sampling import SamplingParams
from skippy_stage.stage import codec, wire
from skippy_stage.stage.stage import Stage
from skippy_stage.stage.steps import (
    PHASE_DECODE,
    PHASE_PREFILL,
    Activations,
    Frame,
    StageShape,
    Step,
    StepEntry,
    forward_step,
    runtime_entries,
)
from skippy_stage.v1 import stage_pb2 as pb

WIDTH = 8
INNER = StageShape(stage_id="stage-1", stage_index=1, layer_start=10, layer_end=20, n_embd=WIDTH,
                   include_embeddings=False, include_output=False, wire_dtype="f32")
FINAL = StageShape(stage_id="stage-2", stage_index=2, layer_start=10, layer_end=30, n_embd=WIDTH,
                   include_embeddings=False, include_output=True, wire_dtype="f32")


def a_frame(dtype: str = "f32", width: int = WIDTH) -> pb.HopRequest:
    """What a stage 0:10 sends on: a decode entry and a prefill entry, as a head sends them."""
    rows = np.arange(3 * width, dtype=np.float32).reshape(3, width) / 7
    desc = wire.make_descriptor(dtype=dtype, producer_stage_index=0, layer_start=0, layer_end=10, token_count=3,
                                sequence_count=2, width=width)
    step = Step(request_id="step-7", return_key="k" * 32, frame=Activations(desc, wire.encode(rows, dtype)), entries=[
        StepEntry("a", (4,), (17,), PHASE_DECODE, sample_last=True, draws_before=2,
                  sampling=SamplingParams(temperature=0.5, top_k=40, seed=5)),
        StepEntry("b", (0, 1), (1, 2), PHASE_PREFILL, sample_last=False),
    ])
    return codec.frame_to_pb(Frame(step, hop_id=3, timeout_s=2.5))


def same_entries(plain: list[BatchEntry], general: list[BatchEntry]) -> None:
    assert len(plain) == len(general)
    for a, b in zip(plain, general):
        for f in fields(BatchEntry):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(y, np.ndarray):
                assert np.array_equal(np.asarray(x), y), f.name
            else:
                assert x == y, f.name


@pytest.mark.parametrize("shape", [INNER, FINAL], ids=["inner", "final"])
@pytest.mark.parametrize("dtype", wire.DTYPES)
def test_a_frame_that_asks_for_layers_only_reads_into_the_entries_the_general_path_builds(shape, dtype):
    msg = a_frame(dtype)
    plain = codec.plain_frame(msg, shape)
    assert plain is not None
    general = codec.frame_from_pb(msg)
    same_entries(plain.entries, runtime_entries(general.step, shape))
    assert (plain.request_id, plain.return_key, plain.hop_id, plain.timeout_s) == ("step-7", "k" * 32, 3, 2.5)
    assert plain.session_ids == ["a", "b"] and plain.dtype == dtype


def test_the_message_sent_on_is_the_one_the_general_path_sends():
    msg = a_frame()
    general = codec.frame_from_pb(pb.HopRequest.FromString(msg.SerializeToString()))
    plain = codec.plain_frame(msg, INNER)
    rows = [np.full((1, WIDTH), 0.25, dtype=np.float32), np.full((2, WIDTH), -1.5, dtype=np.float32)]
    results = [EntryResult("a", hidden=rows[0]), EntryResult("b", hidden=rows[1])]
    general.step.return_key = "fresh-key"
    expected = codec.frame_to_pb(Frame(forward_step(general.step, results, INNER), timeout_s=1.25))
    payload = wire.encode(np.concatenate(rows), INNER.wire_dtype)
    sent = codec.forward_plain(plain, payload, INNER, "fresh-key", 1.25)
    assert sent.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)


def _entry(msg: pb.HopRequest) -> pb.BatchEntry:
    return msg.request.entries[0]


def _desc(msg: pb.HopRequest) -> pb.FrameDescriptor:
    return msg.request.frame.descriptor


MORE_THAN_LAYERS = {
    "relayed": lambda m: setattr(m, "relay", True),
    "rewind": lambda m: setattr(_entry(m), "rewind", True),
    "prefix_id": lambda m: setattr(_entry(m), "prefix_id", "p"),
    "fork_of": lambda m: setattr(_entry(m), "fork_of", "b"),
    "verify": lambda m: setattr(_entry(m), "verify", True),
    "all_rows": lambda m: setattr(_entry(m), "all_rows", True),
    "want_logits": lambda m: setattr(_entry(m), "want_logits", True),
    "top_logprobs": lambda m: setattr(_entry(m), "top_logprobs", 0),
    "prompt_logprobs": lambda m: setattr(_entry(m), "prompt_logprobs", 0),
    "next_token": lambda m: setattr(_entry(m), "next_token", 5),
}
REFUSED_BY_A_CHECK = {
    "no entries": lambda m: m.request.ClearField("entries"),
    "no frame": lambda m: m.request.ClearField("frame"),
    "empty positions": lambda m: _entry(m).ClearField("positions"),
    "token_ids for other positions": lambda m: _entry(m).token_ids.append(3),
    "bad sampling": lambda m: setattr(_entry(m).sampling, "temperature", -1.0),
    "return_key too long": lambda m: setattr(m.request, "return_key", "k" * 65),
    "unknown dtype": lambda m: setattr(_desc(m), "dtype", 99),
    "wire version": lambda m: setattr(_desc(m), "version", 7),
    "layout": lambda m: setattr(_desc(m), "layout", pb.LAYOUT_UNSPECIFIED),
    "layer_end": lambda m: setattr(_desc(m), "layer_end", 9),
    "layer_start": lambda m: setattr(_desc(m), "layer_start", 10),
    "width": lambda m: setattr(_desc(m), "width", WIDTH + 1),
    "sequence_count": lambda m: setattr(_desc(m), "sequence_count", 3),
    "token_count": lambda m: setattr(_desc(m), "token_count", 2),
    "payload_bytes": lambda m: setattr(_desc(m), "payload_bytes", 4),
    "payload cut short": lambda m: setattr(m.request.frame, "payload", m.request.frame.payload[:-4]),
}


@pytest.mark.parametrize("change", [*MORE_THAN_LAYERS, *REFUSED_BY_A_CHECK])
def test_a_frame_asking_more_than_layers_or_failing_a_check_declines_to_the_general_path(change):
    msg = a_frame()
    (MORE_THAN_LAYERS | REFUSED_BY_A_CHECK)[change](msg)
    before = msg.SerializeToString()
    assert codec.plain_frame(msg, FINAL) is None
    assert msg.SerializeToString() == before  # declining changes nothing


def test_the_head_takes_no_plain_frames():
    head = StageShape(stage_id="stage-0", stage_index=0, layer_start=0, layer_end=10, n_embd=WIDTH,
                      include_embeddings=True, include_output=False, wire_dtype="f32")
    assert codec.plain_frame(a_frame(), head) is None


@pytest.fixture(scope="module")
def final_stage(smollm2, slice_cache):
    """The final stage 20:30 of the packaged model, alone: refusals happen before any compute."""
    cfg = split_configs(smollm2, [(0, 20), (20, 30)], slice_cache, n_threads=2, kv_unified=False)[1]
    stage = Stage(cfg, max_message_bytes=cfg.max_message_bytes)
    stage.load()
    yield stage
    stage.close()


def _frame_for(stage: Stage, positions: list[int], rows: np.ndarray) -> pb.HopRequest:
    desc = wire.make_descriptor(dtype="f32", producer_stage_index=0, layer_start=0, layer_end=stage.shape.layer_start,
                                token_count=rows.shape[0], sequence_count=1, width=stage.shape.n_embd)
    step = Step(request_id="r", return_key="key-1", frame=Activations(desc, wire.encode(rows, "f32")),
                entries=[StepEntry("s", tuple(positions), None, PHASE_DECODE, sample_last=True)])
    return codec.frame_to_pb(Frame(step, hop_id=4))


@pytest.mark.parametrize("case", ["unknown session", "non-finite rows"])
def test_a_plain_frame_the_runtime_refuses_gets_the_general_paths_answer_and_leaves_nothing_held(final_stage, case):
    width = final_stage.shape.n_embd
    rows = np.zeros((1, width), dtype=np.float32)
    positions = [5]
    if case == "non-finite rows":
        rows[0, 3], positions = np.nan, [0]
    msg = _frame_for(final_stage, positions, rows)
    answers: dict[str, list] = {"plain": [], "general": []}
    plain = codec.plain_frame(pb.HopRequest.FromString(msg.SerializeToString()), final_stage.shape)
    assert plain is not None
    final_stage.accept_plain(plain, answers["plain"].append)
    final_stage.accept_frame(codec.frame_from_pb(msg), answers["general"].append)
    assert answers["plain"] == answers["general"] and len(answers["plain"]) == 1
    reply = answers["plain"][0]
    assert reply.code in ("NOT_FOUND", "INVALID_ARGUMENT") and reply.failed_stage == final_stage.config.stage_id
    assert reply.session_ids == ("s",) and reply.return_key == "key-1" and reply.hop_id == 4
    assert ("row 0" in reply.message) if case == "non-finite rows" else ("'s'" in reply.message)
    assert final_stage.runtime.stats().active_sessions == 0
