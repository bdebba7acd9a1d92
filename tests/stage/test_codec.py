"""The codec: protobuf at the edge and the domain types in the middle say the same thing.

A step, a frame, a reply, a status report and a drop must survive protobuf and back
unchanged (what a stage sends is what the next one runs), and conversion from protobuf is
total: any message converts, and what a client got wrong is refused by the domain checks,
naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest

from skippy_stage.errors import InvalidRequestError
from skippy_stage.model.lanes import LaneRow, LaneStats
from skippy_stage.model.sampling import SamplingParams
from skippy_stage.stage import codec, wire
from skippy_stage.stage.reports import StageDrop, StageReport
from skippy_stage.stage.steps import (
    PHASE_DECODE,
    PHASE_PREFILL,
    Activations,
    Frame,
    Output,
    Outputs,
    Reply,
    StageShape,
    Step,
    StepEntry,
    runtime_entries,
)
from skippy_stage.v1 import stage_pb2 as pb

WIDTH = 8
SHAPE = StageShape(stage_id="stage-1", stage_index=1, layer_start=10, layer_end=20, n_embd=WIDTH,
                   include_embeddings=False, include_output=False, wire_dtype="f16")


def a_step() -> Step:
    rows = np.arange(3 * WIDTH, dtype=np.float32).reshape(3, WIDTH) / 7
    desc = wire.make_descriptor(dtype="f16", producer_stage_index=0, layer_start=0, layer_end=10, token_count=3,
                                sequence_count=2, width=WIDTH)
    return Step(
        request_id="step-7",
        entries=[
            StepEntry("a", np.array([4]), np.array([17]), PHASE_DECODE, sample_last=True,
                      sampling=SamplingParams(temperature=0.5, top_k=40, seed=5)),  # float32-exact (proto float)
            StepEntry("b", np.array([0, 1]), np.array([1, 2]), PHASE_PREFILL, want_logits=True),
        ],
        frame=Activations(desc, wire.encode(rows, "f16")),
        return_key="k" * 32,
    )


def same_step(x: Step, y: Step) -> None:
    assert (x.request_id, x.return_key) == (y.request_id, y.return_key)
    assert x.frame == y.frame
    for a, b in zip(x.entries, y.entries, strict=True):
        assert (a.session_id, a.phase, a.sample_last, a.want_logits) == (b.session_id, b.phase, b.sample_last,
                                                                          b.want_logits)
        assert list(a.positions) == list(b.positions) and list(a.token_ids) == list(b.token_ids)
        assert (a.sampling or SamplingParams()) == (b.sampling or SamplingParams())


def test_a_frame_survives_protobuf_and_bytes_unchanged():
    frame = Frame(a_step(), hop_id=9, timeout_s=1.5, relay=True, sent_unix_ns=123)
    wire_bytes = codec.frame_to_pb(frame).SerializeToString()
    back = codec.frame_from_pb(pb.HopRequest.FromString(wire_bytes))
    assert (back.hop_id, back.timeout_s, back.relay, back.sent_unix_ns) == (9, 1.5, True, 123)
    same_step(back.step, frame.step)


def test_what_travels_is_what_the_next_stage_runs():
    entries = runtime_entries(codec.step_from_pb(codec.step_to_pb(a_step())), SHAPE)
    assert [e.session_id for e in entries] == ["a", "b"]
    assert [e.hidden.shape for e in entries] == [(1, WIDTH), (2, WIDTH)]
    # An inner stage carries the final stage's flags but acts on none of them.
    assert not any(e.sample or e.want_logits for e in entries)
    assert entries[0].sampling == SamplingParams(temperature=0.5, top_k=40, seed=5)


def test_every_field_of_an_entry_travels_and_reaches_the_runtime_under_its_own_name():
    """The codec and the checks build entries positionally (a keyword dict per entry per frame
    cost as much as the rest of the conversion); a field added or moved must not land in
    another's place."""
    sent = StepEntry("s", (5, 6), (7, 8), PHASE_DECODE, sample_last=True, want_logits=False,
                     sampling=SamplingParams(temperature=0.5, top_k=3, seed=11), prefix_id="p", rewind=True,
                     verify=True, all_rows=True, top_logprobs=4, fork_of="f", prompt_logprobs=2, next_token=9,
                     draws_before=3)
    rows = np.zeros((2, WIDTH), dtype=np.float32)
    desc = wire.make_descriptor(dtype="f32", producer_stage_index=1, layer_start=10, layer_end=20, token_count=2,
                                sequence_count=1, width=WIDTH)
    step = Step("r", [sent], frame=Activations(desc, wire.encode(rows, "f32")))
    got = codec.step_from_pb(codec.step_to_pb(step)).entries[0]
    assert got == sent
    final = StageShape(stage_id="stage-2", stage_index=2, layer_start=20, layer_end=30, n_embd=WIDTH,
                       include_embeddings=False, include_output=True, wire_dtype="f32")
    (entry,) = runtime_entries(Step("r", [got], frame=step.frame), final)
    assert entry.sample and entry.verify and entry.all_rows and entry.rewind and not entry.want_logits
    assert (entry.session_id, entry.prefix_id, entry.fork_of) == ("s", "p", "f")
    assert (entry.top_logprobs, entry.prompt_logprobs, entry.next_token, entry.draws_before) == (4, 2, 9, 3)
    assert entry.positions.tolist() == [5, 6] and entry.token_ids.tolist() == [7, 8]
    assert entry.hidden.shape == (2, WIDTH) and entry.sampling == sent.sampling


def test_outputs_and_replies_round_trip_tokens_logits_and_errors():
    outputs = Outputs([Output("a", 42), Output("b", None, np.array([0.5, -1.0], dtype=np.float32))], "stage-2")
    ok = codec.reply_from_pb(codec.reply_to_pb(Reply(hop_id=3, return_key="k", outputs=outputs)))
    assert ok.code == "OK" and ok.outputs.final_stage_id == "stage-2"
    assert ok.outputs.outputs[0] == Output("a", 42)
    assert ok.outputs.outputs[1].token is None and ok.outputs.outputs[1].logits.tolist() == [0.5, -1.0]
    error = Reply(hop_id=4, return_key="k", code="RESOURCE_EXHAUSTED", message="no lane", failed_stage="stage-1",
                  session_ids=("a", "b"))
    assert codec.reply_from_pb(codec.reply_to_pb(error)) == error


def test_a_status_report_and_drops_round_trip():
    lanes = LaneStats(lane_count=2, active_sessions=1, idle_lanes=0, free_lanes=1, max_session_tokens=7,
                      total_session_tokens=7, kv_pool_tokens=4096, kv_cells_per_lane=2048, discarded_lanes=0,
                      lanes=(LaneRow(0, "active", "a", 7), LaneRow(1, "free", None, 0)))
    report = StageReport(stage_id="stage-1", stage_index=1, run_id="r", topology_id="t", model_id="m",
                         architecture="llama", layer_start=10, layer_end=20, include_embeddings=False,
                         include_output=False, state="serving", wire_dtype="f16", hop_transport="tcp", frame_port=7001,
                         tls=True, downstream_ok=False, downstream_error="down", downstream_stage_id="stage-2",
                         downstream_endpoint="h:1", n_embd=576, lanes=lanes)
    assert codec.report_from_pb(codec.report_to_pb(report)) == report
    drops = [StageDrop("stage-0", True, 0.25), StageDrop("stage-1", False)]
    assert codec.drops_from_pb(codec.drops_to_pb(drops)) == drops


@pytest.mark.parametrize("field, value, named", [
    ("dtype", 99, "frame.descriptor.dtype='99'"),
    ("dtype", pb.DTYPE_UNSPECIFIED, "frame.descriptor.dtype='DTYPE_UNSPECIFIED'"),
    ("layout", pb.LAYOUT_UNSPECIFIED, "frame.descriptor.layout='LAYOUT_UNSPECIFIED'"),
])
def test_a_descriptor_the_wire_cannot_carry_converts_and_is_refused_by_name(field, value, named):
    request = codec.step_to_pb(a_step())
    setattr(request.frame.descriptor, field, value)
    step = codec.step_from_pb(request)  # total: no error here
    with pytest.raises(InvalidRequestError) as refused:
        runtime_entries(step, SHAPE)
    assert named in str(refused.value)


def test_bad_sampling_is_refused_naming_the_entry_and_the_field():
    request = codec.step_to_pb(a_step())
    request.entries[0].sampling.top_p = 0.0
    with pytest.raises(InvalidRequestError, match=r"entries\[0\]\.sampling\.top_p=0\.0"):
        runtime_entries(codec.step_from_pb(request), SHAPE)


def test_a_frame_at_the_head_and_none_below_it_are_refused():
    head = StageShape("stage-0", 0, 0, 10, WIDTH, include_embeddings=True, include_output=False, wire_dtype="f32")
    with pytest.raises(InvalidRequestError, match="frame is not accepted at stage stage-0"):
        runtime_entries(a_step(), head)
    bare = a_step()
    bare.frame = None
    with pytest.raises(InvalidRequestError, match=r"frame is required at stage stage-1 \(layer_start=10\)"):
        runtime_entries(bare, SHAPE)


def test_sampling_settings_that_travel_with_every_token_are_parsed_once_and_never_mixed_up():
    """A session sends the same sampling message with every token; each stage parses it once.
    Different settings still get their own values, and the memo stays bounded in entries and
    in bytes."""
    greedy = codec.sampling_to_pb(SamplingParams(temperature=0.0))
    warm = codec.sampling_to_pb(SamplingParams(temperature=0.7, top_k=40, seed=3))

    def entry(msg):
        return codec.entry_from_pb(pb.BatchEntry(session_id="s", positions=[0], sample_last=True, sampling=msg))

    first, again, other = entry(greedy).sampling, entry(greedy).sampling, entry(warm).sampling
    assert first is again
    assert other == SamplingParams(temperature=np.float32(0.7).item(), top_k=40, seed=3)
    assert first == SamplingParams(temperature=0.0)
    for seed in range(3 * codec._SAMPLING_SEEN_MAX):
        assert entry(codec.sampling_to_pb(SamplingParams(seed=seed))).sampling.seed == seed
    assert len(codec._SAMPLING_SEEN) <= codec._SAMPLING_SEEN_MAX
    grammar = codec.sampling_to_pb(SamplingParams(grammar="root ::= " + '"a" ' * 400))
    assert entry(grammar).sampling.grammar.startswith("root ::=")
    assert grammar.SerializeToString() not in codec._SAMPLING_SEEN  # large messages are not kept


def test_the_heads_sampling_message_is_built_once_per_settings_object():
    """The head's entries carry one session's SamplingParams object step after step."""
    params = SamplingParams(temperature=0.5, seed=9)
    one = codec.entry_to_pb(StepEntry("s", [4], [1], PHASE_DECODE, sample_last=True, sampling=params))
    two = codec.entry_to_pb(StepEntry("s", [5], [2], PHASE_DECODE, sample_last=True, sampling=params))
    assert one.sampling == two.sampling == codec.sampling_to_pb(params)
    assert codec._sampling_msg(params) is codec._sampling_msg(params)
    grammar = SamplingParams(grammar="root ::= " + '"a" ' * 400)
    assert codec._sampling_msg(grammar) == codec.sampling_to_pb(grammar)
    assert id(grammar) not in codec._SAMPLING_SENT  # large settings are not kept
    other = SamplingParams(temperature=0.5, seed=10)
    assert codec.entry_to_pb(StepEntry("s", [4], [1], PHASE_DECODE, sample_last=True, sampling=other)).sampling.seed == 10
