"""The compiled frame path (``stage/native_frames.py``, ``stage/native/*.c``): of the stages below
the head, and of the head's own decode steps.

It stands in for the Python frame path on plain decode frames, so it must be indistinguishable
from it: at the final stage the same token for the same frame, the same session state after it
(lane length, batch count, history), a ReturnedBatch the head's codec reads as the Python path's;
at an inner stage the same rows bit for bit, the entries sent on as they came, the return key
routed where replies from below will look for it. Every frame it cannot prove plain it must
*decline* without touching anything, so the Python path runs it and gives its usual refusal,
naming the field. Checked in one process against the real SmolLM2 splits 0:15 / 15:30 and
0:10 / 10:20 / 20:30 (a socket pair standing for the next link), and on real ``serve`` processes.
The bench (the chains, the paths on them, the frames the stages above send) is ``support/frames.py``;
mutated frames go through the same paths in ``test_frame_fuzz.py``.
"""

from __future__ import annotations

import math
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support.frames import (
    N_EMBD,
    PROMPT,
    SINK,
    STAGE_ID,
    Below,
    Edge,
    body,
    head_rows,
    head_step,
    lone,
    lone_entry,
    prefill,
    read_forwarded,
    returned,
    state,
)
from support.mutations import Field, encode, fields, put_varint
from support.pipeline import assert_no_active_sessions, grpc_generate, metric, reference_texts, scrape, status
from support.waiting import eventually

from skippy_stage.cli.local import free_ports
from skippy_stage.errors import DownstreamError, InvalidRequestError
from skippy_stage.model.runtime import BatchEntry
from skippy_stage.model.sampling import SamplingParams
from skippy_stage.security import Credentials
from skippy_stage.stage import framing, native_frames
from skippy_stage.stage.codec import sampling_to_pb
from skippy_stage.stage.gate import EdgeGate
from skippy_stage.v1 import stage_pb2 as pb


def test_a_plain_decode_frame_gives_the_python_paths_token_session_state_and_message(chain, native, link):
    head, tail = chain.stages
    pos, token = prefill(chain, "py")
    assert prefill(chain, "nat") == (pos, token)
    try:
        for _ in range(12):
            row = head_rows(head, "h-py", [pos], [token])
            expected = tail.run_batch([BatchEntry("py", np.asarray([pos]), token_ids=np.asarray([token]), hidden=row,
                                                  sample=True, sampling=SamplingParams())])[0].token
            done = native.run(body("nat", pos, token, row, return_key=f"k{pos}"), link.ours, link.lock, None)
            assert done is not None and done[0] == 0, done
            returned = link.read()
            assert returned.return_key == f"k{pos}"
            assert returned.response.final_stage_id == STAGE_ID
            [out] = returned.response.outputs
            assert (out.session_id, out.has_token, out.token) == ("nat", True, expected)
            status_code, _, compute_s, latency_s, entries, payload_bytes, message, marks, key = done
            assert entries == 1 and payload_bytes == 4 * N_EMBD and message is None and key is None
            assert compute_s > 0 and latency_s >= 0 and all(marks)
            token, pos = expected, pos + 1
        assert state(tail, "nat") == state(tail, "py")
        assert not link.pending()
    finally:
        for session in ("py", "nat"):
            tail.drop_session(session)
        head.drop_session("h-py")
        head.drop_session("h-nat")


def test_frames_it_cannot_prove_plain_are_declined_and_touch_nothing(chain, native, link):
    head, tail = chain.stages
    pos, token = prefill(chain, "d")
    row = head_rows(head, "h-d", [pos], [token])
    nan = row.copy()
    nan[0, 7] = np.nan
    plain = body("d", pos, token, row)
    declined = {
        "the session's position is not its next one": body("d", pos + 1, token, row),
        "the session is not bound here": body("nobody", pos, token, row),
        "the head asked for the outputs relayed": body("d", pos, token, row, relay=True),
        "it asks for logits": body("d", pos, token, row, want_logits=True),
        "seeded sampling": body("d", pos, token, row, sampling=sampling_to_pb(SamplingParams(temperature=0.7, seed=3))),
        "a repetition penalty": body("d", pos, token, row, sampling=sampling_to_pb(SamplingParams(repeat_penalty=1.3))),
        "an invalid setting": body("d", pos, token, row, sampling=pb.SamplingParams(top_k=-1)),
        "top_logprobs": body("d", pos, token, row, top_logprobs=2),
        "a non-finite row": body("d", pos, token, nan),
        "a row of the wrong width": body("d", pos, token, row[:, :-1]),
        "a token id outside the vocabulary": body("d", pos, 49152, row),
        "no return key": body("d", pos, token, row, return_key=""),
        "a session id that is not ASCII": body("dé", pos, token, row),
        "a field it does not know": plain + b"\xb0\x06\x01",  # field 102, varint
        "a prefix id": body("d", pos, token, row, prefix_id="p"),
        # Descriptor fields are 32 bits wide: the Python path reads a longer varint cut to 32 bits (this
        # one as 4294967295, above layer_end: refused), where a signed 64-bit reading gives -1, below it.
        "a layer_start of 2^64 - 1": descriptor_varint(plain, 5, 2**64 - 1),
        "a width of 2^32 + 576": descriptor_varint(plain, 11, 2**32 + N_EMBD),
    }
    before = state(tail, "d")
    try:
        for why, frame in declined.items():
            assert native.run(frame, link.ours, link.lock, None) is None, why
            assert state(tail, "d") == before, why
        assert not link.pending()
        # Every cut of a frame either no longer parses (declined) or ends at a field boundary. The
        # cut before sent_unix_ns, its last field, is a whole frame without a send time: it runs,
        # once (the session then moves on and the old position declines).
        ran = 0
        for cut in range(len(plain)):
            done = native.run(plain[:cut], link.ours, link.lock, None)
            assert done is None or done[0] == 0
            ran += done is not None
        assert ran == 1
        assert state(tail, "d")[0] == before[0] + 1
        assert link.read().response.outputs[0].session_id == "d"
    finally:
        tail.drop_session("d")
        head.drop_session("h-d")


def descriptor_varint(frame: bytes, number: int, value: int) -> bytes:
    """``frame`` (a HopRequest's bytes) with its descriptor's field ``number`` a varint of ``value``, up
    to 64 bits as the wire allows (protobuf's own 32-bit fields cannot hold them)."""
    hop = fields(frame)
    (request,) = [f for f in hop if f.number == 2]
    inner = fields(request.value)
    (activation,) = [f for f in inner if f.number == 3]
    parts = fields(activation.value)
    (descriptor,) = [f for f in parts if f.number == 1]
    descriptor.value = encode([*(f for f in fields(descriptor.value) if f.number != number),
                               Field(number, 0, put_varint(value))])
    activation.value = encode(parts)
    request.value = encode(inner)
    return encode(hop)


def test_corrupted_frames_never_crash_it_and_keep_the_session_consistent(chain, native, link):
    """Random byte flips anywhere in a plain frame: each is declined or runs as a valid frame."""
    head, tail = chain.stages
    pos, token = prefill(chain, "f")
    row = head_rows(head, "h-f", [pos], [token])
    plain = bytearray(body("f", pos, token, row))
    rng = random.Random(7)
    start = tail.lanes.lane_of("f").n_tokens
    ran = 0
    try:
        for _ in range(400):
            frame = bytearray(plain)
            for _ in range(rng.randint(1, 4)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
            done = native.run(bytes(frame), link.ours, link.lock, None)
            assert done is None or done[0] == 0
            if done is not None:
                ran += 1
                link.read()
        assert ran > 0  # flips in the rows that keep them finite still run
        lane = tail.lanes.lane_of("f")
        assert lane.n_tokens == start + ran
        assert len(tail._history["f"]) == lane.n_tokens + 1  # the last sample, fed by the next step
    finally:
        tail.drop_session("f")
        head.drop_session("h-f")


# -- an inner stage ------------------------------------------------------------------------------


def test_an_inner_stage_sends_on_the_python_paths_rows_with_the_entries_as_they_came(chain3, inner, link):
    head, middle, _ = chain3.stages
    path, routes = inner
    tokens = middle.tokenizer.tokenize(PROMPT)
    rows = head_rows(head, "h", range(len(tokens)), tokens)
    sink = object()  # the link's back channel, which owns the sessions it opened
    for session in ("py", "nat"):
        middle.run_batch([BatchEntry(session, np.arange(len(tokens)), token_ids=np.asarray(tokens), hidden=rows)],
                         sink if session == "nat" else None)
    pos, token = len(tokens), 42
    try:
        # A session another link opened is not this one's to run in C: declined, nothing done.
        assert path.run(body("nat", pos, token, np.zeros((1, N_EMBD), np.float32), layer_end=10), link.ours,
                        link.lock, object()) is None
        assert middle.lanes.lane_of("nat").n_tokens == pos and not link.pending()
        for step in range(8):
            row = head_rows(head, "h", [pos], [token])
            expected = middle.run_batch([BatchEntry("py", np.asarray([pos]), token_ids=np.asarray([token]),
                                                    hidden=row)])[0].hidden
            sent = body("nat", pos, token, row, layer_end=10, return_key="" if step == 0 else f"k{step}",
                        timeout_s=100.0 if step % 2 else 0.5)
            done = path.run(sent, link.ours, link.lock, sink)
            assert done is not None and done[0] == 0, done
            key = done[8]
            forwarded = read_forwarded(link, sent, expected, producer=1, layers=(10, 20))
            request = forwarded.request
            assert request.request_id == "r" and not forwarded.relay and forwarded.sent_unix_ns > 0
            assert forwarded.timeout_s == (2.5 if step % 2 else 0.5)  # what is left, capped by the hop timeout
            # Replies from below come back under the key routed here: a fresh one for an empty key.
            assert request.return_key == key and (key == f"k{step}" if step else len(key) == 32)
            assert routes.take(key) == (sink, 3)
            pos, token = pos + 1, token + 1
        assert middle.lanes.lane_of("nat").n_tokens == middle.lanes.lane_of("py").n_tokens == pos
        assert middle.lanes.lane_of("nat").batches == middle.lanes.lane_of("py").batches
    finally:
        for session in ("py", "nat"):
            middle.drop_session(session)
        head.drop_session("h")


def test_an_inner_send_that_fails_hands_the_frame_back_for_the_edge_to_be_reported(chain3, inner, link):
    head, middle, _ = chain3.stages
    path, routes = inner
    tokens = middle.tokenizer.tokenize(PROMPT)
    rows = head_rows(head, "h2", range(len(tokens)), tokens)
    middle.run_batch([BatchEntry("s", np.arange(len(tokens)), token_ids=np.asarray(tokens), hidden=rows)])
    try:
        link.theirs.close()  # the stage below is gone
        row = head_rows(head, "h2", [len(tokens)], [7])
        done = path.run(body("s", len(tokens), 7, row, layer_end=10), link.ours, link.lock, None)
        assert done is not None and done[0] == 1
        assert pb.HopRequest.FromString(done[6]).request.return_key == done[8]
    finally:
        middle.drop_session("s")
        head.drop_session("h2")


# -- the head's own steps ------------------------------------------------------------------------


def test_the_heads_step_sends_the_python_paths_rows_under_the_key_its_wait_is_registered_with(
        chain3, head_path, link):
    head = chain3.stages[0]
    tokens = head.tokenizer.tokenize(PROMPT)
    for session in ("py", "nat"):
        head_rows(head, session, range(len(tokens)), tokens)
    pos, token = len(tokens), 42
    try:
        for step in range(8):
            expected = head_rows(head, "py", [pos], [token])
            sent = head_step("nat", pos, token, return_key=f"key-{step}", timeout_s=100.0 if step % 2 else 0.5)
            done = head_path.run(sent, link.ours, link.lock, None)
            assert done is not None and done[0] == 0, done
            assert done[8] is None  # the head routes nothing: the key is the one its wait is under
            forwarded = read_forwarded(link, sent, expected, producer=0, layers=(0, 10))
            request = forwarded.request
            assert request.return_key == f"key-{step}" and request.request_id == "step-1"
            assert forwarded.timeout_s == (2.5 if step % 2 else 0.5) and forwarded.sent_unix_ns > 0
            pos, token = pos + 1, token + 1
        assert head.lanes.lane_of("nat").n_tokens == head.lanes.lane_of("py").n_tokens == pos
        assert head.lanes.lane_of("nat").batches == head.lanes.lane_of("py").batches
    finally:
        for session in ("py", "nat"):
            head.drop_session(session)


def corrupt_sampling(frame: bytes) -> bytes:
    """``frame`` with its sampling's grammar made invalid UTF-8 (the same length: every length around it
    still holds), which protobuf refuses to parse."""
    at = frame.index(b"root ::= x")
    return frame[:at] + b"\xff" + frame[at + 1 :]


def test_head_steps_it_cannot_prove_plain_are_declined_and_touch_nothing(chain3, head_path, link):
    head = chain3.stages[0]
    tokens = head.tokenizer.tokenize(PROMPT)
    head_rows(head, "s", range(len(tokens)), tokens)
    pos = len(tokens)
    try:
        declined = {
            "rows at the head": head_step("s", pos, 7, with_frame=True),
            "no return key": head_step("s", pos, 7, return_key=""),
            "no token": head_step("s", pos, 7, token_ids=[]),
            "two positions": head_step("s", pos, 7, positions=[pos, pos + 1], token_ids=[7, 8]),
            "a token outside the vocabulary": head_step("s", pos, 1 << 20),
            "a position the session is not at": head_step("s", pos + 1, 7),
            "a session the head does not hold": head_step("ghost", pos, 7),
            "a rewind": head_step("s", pos, 7, rewind=True),
            "invalid sampling": head_step("s", pos, 7, sampling=pb.SamplingParams(temperature=-1.0)),
            # an entry that samples nothing still carries its sampling on: it must parse
            "undecodable sampling on an entry that does not sample": corrupt_sampling(
                head_step("s", pos, 7, sample_last=False, sampling=pb.SamplingParams(grammar="root ::= x"))),
        }
        with pytest.raises(Exception, match="Error parsing message"):
            pb.HopRequest.FromString(declined["undecodable sampling on an entry that does not sample"])
        for why, frame in declined.items():
            assert head_path.run(frame, link.ours, link.lock, None) is None, why
        assert head.lanes.lane_of("s").n_tokens == pos
        assert not link.pending()
    finally:
        head.drop_session("s")


# -- the head's lone generation (``FramePath.lone``) -----------------------------------------------


def test_a_lone_run_feeds_each_returned_token_to_the_next_step_until_its_limit(chain3, head_path, lone_head, link):
    head, pos = lone_head
    wait = native_frames._frames.ReturnWait(n_vocab=head.tokenizer.n_vocab)
    script = iter([101, 102, 103, 104])
    below = Below(link, wait, lambda request: returned(request.return_key, "lone", next(script)))
    fed: list[int | None] = []
    how, value, steps, computes, hops, final_id = lone(
        head_path, Edge(link), wait, lone_entry("lone"), pos, 42, limit=3, on_token=lambda t: fed.append(t) or True)
    assert (how, value, steps, final_id) == (native_frames.LONE_TOKEN, 103, 3, "stage-final")
    assert fed == [None, 101, 102]  # each token once the frame that fed it has left
    # the lone loop is woken before ``Below`` books what it took: wait for the booking
    assert len(computes) == len(hops) == 3 and eventually(lambda: below.taken, lambda t: len(t) >= 3) == [True] * 3
    for step, (frame, token) in enumerate(zip(below.frames, [42, 101, 102])):
        expected = head_rows(head, "py", [pos + step], [token])
        assert np.array_equal(np.frombuffer(frame.request.frame.payload, dtype=np.float32).reshape(1, N_EMBD),
                              expected)
        (entry,) = frame.request.entries
        assert (list(entry.positions), list(entry.token_ids), entry.draws_before) == ([pos + step], [token], pos + step)
        assert frame.request.request_id == ("step-7" if step == 0 else f"step-7+{step}")
    keys = [f.request.return_key for f in below.frames]
    assert len(set(keys)) == 3 and all(k.startswith("run.") for k in keys)
    assert head.lanes.lane_of("lone").n_tokens == head.lanes.lane_of("py").n_tokens == pos + 3


def test_a_lone_run_rings_the_handlers_bell_only_when_its_callback_asks(chain3, head_path, lone_head, link):
    """The token callback runs with the GIL held; a handler woken there would block on the GIL and
    be woken again. So the callback puts its tokens quietly and asks (bit 1) for the bell, which the
    C loop rings once it has released the GIL; a callback that put nothing does not ring it."""
    head, pos = lone_head
    wait = native_frames._frames.ReturnWait(n_vocab=head.tokenizer.n_vocab)
    Below(link, wait, lambda request: returned(request.return_key, "lone", 7))
    bell = native_frames._frames.Bell()
    woken: list[bool] = []
    waiter = threading.Thread(target=lambda: woken.append(bell.wait(5.0)))
    waiter.start()
    done = lone(head_path, Edge(link), wait, lone_entry("lone"), pos, 42, limit=2, bell=bell,
                on_token=lambda t: 1 if t is None else 3)  # the second step's callback asks for a ring
    waiter.join(10)
    assert done[:3] == (native_frames.LONE_TOKEN, 7, 2)
    assert woken == [True]
    assert bell.wait(0.0) is False  # rung once, not at the first step's callback
    done = lone(head_path, Edge(link), wait, lone_entry("lone"), pos + 2, 42, limit=2, bell=bell,
                on_token=lambda t: 1)
    assert done[:3] == (native_frames.LONE_TOKEN, 7, 2) and bell.wait(0.05) is False


def test_a_lone_run_stops_after_an_end_of_generation_token_or_when_told(chain3, head_path, lone_head, link):
    head, pos = lone_head
    wait = native_frames._frames.ReturnWait(n_vocab=head.tokenizer.n_vocab)
    Below(link, wait, lambda request: returned(request.return_key, "lone", 2 if request.entries[0].positions[0]
                                              == pos + 1 else 9))
    done = lone(head_path, Edge(link), wait, lone_entry("lone"), pos, 42, eog=(2,))
    assert done[:3] == (native_frames.LONE_TOKEN, 2, 2)
    # told to stop: the step in flight still comes back, and its token is the caller's
    done = lone(head_path, Edge(link), wait, lone_entry("lone"), pos + 2, 42, on_token=lambda t: False)
    assert done[:3] == (native_frames.LONE_TOKEN, 9, 1)


def test_what_settles_the_awaited_step_ends_the_run_with_it(chain3, head_path, lone_head, link):
    head, pos = lone_head
    wait = native_frames._frames.ReturnWait(n_vocab=head.tokenizer.n_vocab)
    failure = DownstreamError("stage-final failed", stage_id="stage-final", code_name="UNAVAILABLE")
    answers = iter([lambda r: returned(r.return_key, "lone", 7), lambda r: failure])
    below = Below(link, wait, lambda request: next(answers)(request))
    done = lone(head_path, Edge(link), wait, lone_entry("lone"), pos, 42)
    assert done[:3] == (native_frames.LONE_SETTLED, failure, 2)
    assert eventually(lambda: below.taken, lambda t: len(t) >= 2) == [True, True]
    assert head.lanes.lane_of("lone").n_tokens == pos + 2  # the head's part of each step ran
    # a second run on the same wait starts clean
    below.answer = lambda r: returned(r.return_key, "lone", 5)
    assert lone(head_path, Edge(link), wait, lone_entry("lone"), pos + 2, 7, limit=1)[:3] == (
        native_frames.LONE_TOKEN, 5, 1)


def test_a_step_that_cannot_be_sent_gives_back_the_token_it_fed_for_the_scheduler_to_take(
        chain3, head_path, lone_head, link):
    head, pos = lone_head
    wait = native_frames._frames.ReturnWait(n_vocab=head.tokenizer.n_vocab)

    def answer(request):
        link.ours.close()  # the link breaks before the next step's send
        return returned(request.return_key, "lone", 7)
    Below(link, wait, answer)
    fed: list[int | None] = []
    done = lone(head_path, Edge(link), wait, lone_entry("lone"), pos, 42, on_token=lambda t: fed.append(t) or True)
    assert done[:3] == (native_frames.LONE_UNSENT, (0, 7), 1) and fed == [None]
    assert head.lanes.lane_of("lone").n_tokens == pos + 2  # the second step decoded here, then failed to leave


def test_a_return_that_is_not_one_plain_token_of_the_awaited_step_is_left_to_the_python_path(
        chain3, head_path, lone_head, link):
    head, pos = lone_head
    wait = native_frames._frames.ReturnWait(n_vocab=head.tokenizer.n_vocab)
    assert not wait.take(returned("run.0", "lone", 5))  # nothing awaited yet
    assert not wait.settle("run.0", RuntimeError("x")) and not wait.settle(None, RuntimeError("x"))
    refused: list[bool] = []

    def answer(request):
        key = request.return_key
        refused.extend([
            wait.take(returned("other-key", "lone", 5)),
            wait.take(returned(key, "someone-else", 5)),
            wait.take(returned(key, "lone", head.tokenizer.n_vocab)),
            wait.take(returned(key, "lone", 5, extra={"logits": [0.5]})),
            wait.take(b"\xff\x01garbage"),
            wait.settle("other-key", RuntimeError("x")),
        ])
        return pb.IterationBatchResponse(outputs=[pb.EntryOutput(session_id="lone", has_token=True, token=5,
                                                                 logits=[0.5])])
    Below(link, wait, answer)
    how, value, steps, *_ = lone(head_path, Edge(link), wait, lone_entry("lone"), pos, 42)
    assert refused == [False] * 6
    assert how == native_frames.LONE_SETTLED and steps == 1 and list(value.outputs[0].logits) == [0.5]


def test_a_lone_run_gives_up_on_a_silent_chain_and_declines_once_the_edge_changed(
        chain3, head_path, lone_head, link):
    head, pos = lone_head
    wait = native_frames._frames.ReturnWait(n_vocab=head.tokenizer.n_vocab)
    # silent on the step at pos; the one at pos + 1 is answered
    below = Below(link, wait, lambda request: returned(request.return_key, "lone", 5)
                  if list(request.entries[0].positions) == [pos + 1] else None)
    # A path whose own hop limit is 10 minutes: a run that waited for that rather than its
    # timeout_s would outlast the bounded wait for its end below by far.
    patient = native_frames.frame_path(chain3.stages[0].native_frame_args(), hop_timeout_s=600.0, routes=None,
                                       stage_id=b"stage-head")
    pool = ThreadPoolExecutor(1)
    try:
        started = time.monotonic()
        silent = pool.submit(lone, patient, Edge(link), wait, lone_entry("lone"), pos, 42, timeout_s=0.2)
        assert silent.result(timeout=60)[:3] == (native_frames.LONE_TIMEOUT, None, 1)
        assert time.monotonic() - started >= 0.2  # it waited its timeout out
    finally:
        pool.shutdown(wait=False)
    edge = Edge(link)
    edge.stage.downstream = types.SimpleNamespace(hop=edge.downstream.hop)  # a hand-off switched it
    assert lone(head_path, edge, wait, lone_entry("lone"), pos + 1, 42)[:3] == (native_frames.LONE_DECLINED, 42, 0)
    assert head.lanes.lane_of("lone").n_tokens == pos + 1  # the declined run computed nothing
    # ... and sent nothing: the next frame on the link after the silent one is the next run's.
    assert lone(head_path, Edge(link), wait, lone_entry("lone"), pos + 1, 43, limit=1)[:3] == (
        native_frames.LONE_TOKEN, 5, 1)
    sent = [(list(f.request.entries[0].positions), list(f.request.entries[0].token_ids)) for f in below.frames]
    assert sent == [([pos], [42]), ([pos + 1], [43])]
    assert head.lanes.lane_of("lone").n_tokens == pos + 2


def test_the_heads_return_reader_hands_the_awaited_token_over_and_gives_back_everything_else(
        chain3, head_path, lone_head, link):
    """The head's return listener reads a plain link in C (``FrameReader``): the lone run's token is
    taken on the way, without returning to Python; any other message comes back as
    ``FrameSocket.receive`` gives it, a length it cannot read past as (-1, why), the end as None."""
    head, pos = lone_head
    wait = native_frames._frames.ReturnWait(n_vocab=head.tokenizer.n_vocab)
    ours, theirs = socket.socketpair()
    reader = native_frames._frames.FrameReader(theirs.fileno(), 1 << 16, b"")
    seen: list = []

    def listen() -> None:
        while (got := reader.next(wait)) is not None:
            seen.append(got)
            if got[0] == -1:
                return

    def answer(request):
        ours.sendall(framing.encode(framing.Kind.RETURNED_BATCH, pb.ReturnedBatch.FromString(
            returned("not-awaited", "lone", 3))))
        ours.sendall(framing.encode(framing.Kind.RETURNED_BATCH, pb.ReturnedBatch.FromString(
            returned(request.return_key, "lone", 11))))
    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        Below(link, wait, answer)
        done = lone(head_path, Edge(link), wait, lone_entry("lone"), pos, 42, limit=2)
        assert done[:3] == (native_frames.LONE_TOKEN, 11, 2)
        ours.sendall(framing._HEADER.pack(1 << 20, framing.Kind.RETURNED_BATCH))
        listener.join(5)
        assert [kind for kind, _ in seen] == [framing.Kind.RETURNED_BATCH] * 2 + [-1]
        assert all(pb.ReturnedBatch.FromString(body).return_key == "not-awaited" for _, body in seen[:2])
        assert "exceeds max_message_bytes=65536" in seen[2][1]
    finally:
        ours.close()
        theirs.close()
    peer, end = socket.socketpair()
    peer.close()
    try:
        assert native_frames._frames.FrameReader(end.fileno(), 1 << 16, b"").next(None) is None
    finally:
        end.close()


def test_a_served_link_runs_its_plain_frames_in_c_and_hands_back_everything_else(chain, native, link):
    """``FramePath.serve`` reads a frame link and runs each plain frame alone on it as ``run`` would
    (``begin`` giving the output's socket, ``end`` told each outcome), until a message the Python
    path must take: another kind, a frame with another behind it (coalesced in Python), a frame the
    stage cannot take now (``begin`` None), or one it cannot prove plain — each handed back as sent,
    nothing of it done."""
    head, tail = chain.stages
    pos, token = prefill(chain, "sv-py")
    assert prefill(chain, "sv", SINK) == (pos, token)
    upstream, ours = socket.socketpair()
    reader = native_frames._frames.FrameReader(ours.fileno(), 1 << 20, b"")
    taking = [True]
    ended: list = []
    handed: list = []

    def begin():
        return (link.ours, link.lock, "held") if taking[0] else None

    def end(held, done, frame, sink):
        assert held[2] == "held" and sink is SINK
        ended.append((done[0] if done is not None else None, frame))

    def serve() -> None:  # as the listener does: what came with a handed-back message is read with it
        while (got := native.serve(reader, begin, end, SINK)) is not None:
            handed.append(got)
            while reader.readable():
                handed.append(reader.next(None))

    def frame_for(session: str, at: int, fed: int, key: str) -> bytes:
        return body(session, at, fed, head_rows(head, "h-sv-py", [at], [fed]), return_key=key)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        for step in range(2):
            expected = tail.run_batch([BatchEntry("sv-py", np.asarray([pos]), token_ids=np.asarray([token]),
                                                  hidden=head_rows(head, "h-sv", [pos], [token]), sample=True,
                                                  sampling=SamplingParams())])[0].token
            upstream.sendall(framing.encode(framing.Kind.HOP_REQUEST, pb.HopRequest.FromString(
                frame_for("sv", pos, token, f"s{step}"))))
            returned = link.read()
            [out] = returned.response.outputs
            assert (returned.return_key, out.session_id, out.token) == (f"s{step}", "sv", expected)
            token, pos = expected, pos + 1
        eventually(lambda: len(ended), lambda n: n >= 2)  # ``end`` follows the send the reply was read from
        assert ended == [(0, None), (0, None)]
        hello = framing.encode(framing.Kind.HELLO, pb.FrameHello(stage_id="x"))
        row = head_rows(head, "h-sv-py", [pos], [token])
        two, unknown, alone = (body(session, pos, token, row, return_key=key)
                               for session, key in (("sv", "t0"), ("nobody", "t1"), ("sv", "t2")))
        wire = [framing.encode(framing.Kind.HOP_REQUEST, pb.HopRequest.FromString(b)) for b in (two, unknown, alone)]
        upstream.sendall(hello)
        upstream.sendall(wire[0] + wire[0])  # a frame with another behind it
        eventually(lambda: len(handed), lambda k: k >= 3)
        assert handed == [(framing.Kind.HELLO, hello[5:]), (framing.Kind.HOP_REQUEST, two),
                          (framing.Kind.HOP_REQUEST, two)]
        upstream.sendall(wire[1])  # a session this stage does not hold: declined inside the run
        eventually(lambda: len(handed), lambda k: k >= 4)
        taking[0] = False
        upstream.sendall(wire[2])  # begin() says the Python path takes it
        eventually(lambda: len(handed), lambda k: k >= 5)
        assert handed[3:] == [(framing.Kind.HOP_REQUEST, unknown), (framing.Kind.HOP_REQUEST, alone)]
        assert ended == [(0, None), (0, None), (None, None)]
        assert not link.pending()
        assert state(tail, "sv") == state(tail, "sv-py")
    finally:
        upstream.close()
        server.join(5)
        ours.close()
        for session in ("sv-py", "sv"):
            tail.drop_session(session)
        for session in ("h-sv-py", "h-sv"):
            head.drop_session(session)


def test_a_served_links_plain_successes_are_kept_for_one_bulk_record_and_leave_the_gate_in_c(chain, native, link):
    """Given a list, ``serve`` keeps a frame sent on as plain success there instead of calling ``end``
    (its metrics are recorded in bulk, at a scrape), leaving the gate ``begin`` passed (``held``'s
    fifth item) itself; a full list, or a gate it does not know, and ``end`` is called as before."""
    head, tail = chain.stages
    pos, token = prefill(chain, "kp", SINK)
    upstream, ours = socket.socketpair()
    reader = native_frames._frames.FrameReader(ours.fileno(), 1 << 20, b"")
    gate = EdgeGate()
    kept: list = []
    ended: list = []
    handed: list = []
    helds = iter([gate.passing(), gate.passing(), gate.passing(), object()])

    def begin():
        held = next(helds)
        if held is gate.passing():
            held.__enter__()
        return (link.ours, link.lock, "target", "link", held)

    def end(held, done, frame, sink):
        if held[4] is gate.passing():
            held[4].__exit__(None, None, None)
        ended.append(done[0])

    def serve() -> None:
        while (got := native.serve(reader, begin, end, SINK, kept)) is not None:
            handed.append(got)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        for step in range(4):
            if step == 2:
                kept.extend([None] * (1024 - len(kept)))  # full: the next frame goes to ``end``
            rows = head_rows(head, "h-kp", [pos], [token])
            upstream.sendall(framing.encode(framing.Kind.HOP_REQUEST, pb.HopRequest.FromString(
                body("kp", pos, token, rows, return_key=f"k{step}"))))
            [out] = link.read().response.outputs
            token, pos = out.token, pos + 1
            if step == 1:
                assert eventually(lambda: len(kept), lambda n: n >= 2) == 2
                assert [done[0] for done in kept] == [0, 0] and ended == []
                assert gate.wait_idle(1), "serve left the gate of each frame it kept"
        del kept[:]
        assert eventually(lambda: len(ended), lambda n: n >= 2) == 2  # the full list's frame, the unknown gate's
        assert ended == [0, 0] and not kept and gate.wait_idle(1)
    finally:
        upstream.close()
        server.join(5)
        ours.close()
        tail.drop_session("kp")
        head.drop_session("h-kp")


def test_a_link_read_in_c_answers_receive_and_readable_as_the_python_reader_does():
    """A stage below the head reads its upstream's plain link in C (``native_frames.link_reader``),
    with ``FrameSocket``'s contract: whole messages in order, ``readable`` only for a whole message
    already buffered, what the Python reader had buffered taken over, the same refusal of a length
    it cannot read past, and the end as LinkClosed."""
    def message(i: int, size: int = 40) -> bytes:
        return framing.encode(framing.Kind.HOP_REQUEST, pb.HopRequest(hop_id=i, request=pb.IterationBatchRequest(
            request_id="r" * size)))

    def readers():
        for native in (False, True):
            ours, theirs = socket.socketpair()
            link = framing.FrameSocket(theirs, max_message_bytes=1 << 16)
            ours.sendall(message(0) + message(1) + message(2, 5000)[:100])
            assert link.receive()[1] == message(0)[5:]  # the Python reader buffers what came with it
            yield ours, native_frames.link_reader(link) if native else link
            ours.close()
            theirs.close()

    seen = []
    for ours, reads in readers():
        steps = [reads.readable(), reads.receive(), reads.readable()]
        ours.sendall(message(2, 5000)[100:])
        steps += [reads.receive(), reads.readable()]
        ours.sendall(framing._HEADER.pack(1 << 20, framing.Kind.HOP_REQUEST))
        with pytest.raises(InvalidRequestError, match="exceeds max_message_bytes=65536"):
            reads.receive()
        seen.append(steps)
    python, native = seen
    assert native == python == [True, (framing.Kind.HOP_REQUEST, message(1)[5:]), False,
                                (framing.Kind.HOP_REQUEST, message(2, 5000)[5:]), False]
    peer, end = socket.socketpair()
    peer.close()
    try:
        with pytest.raises(framing.LinkClosed):
            native_frames.link_reader(framing.FrameSocket(end, max_message_bytes=1 << 16)).receive()
    finally:
        end.close()


# -- on real serve processes ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(smollm2):
    return reference_texts(smollm2, [PROMPT], 24)[0]


def native_count(port: int) -> float:
    return metric(scrape(port), "skippy_native_frames_total")


def settled(port: int, at_least: float) -> float:
    """The native frame count once it reaches ``at_least`` (metrics are recorded after the send)."""
    return eventually(lambda: native_count(port), lambda count: count >= at_least)


def test_a_pipelines_greedy_decode_frames_run_natively_with_the_unsplit_models_text(
        smollm2, start_pipeline, reference):
    ports = free_ports("127.0.0.1", 2)
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, metrics_port=ports)
    text, last = grpc_generate(pipeline.head_endpoint, PROMPT, 24)
    assert text == reference
    # Every decode step but the prompt's (several positions: Python) ran natively, at the head (its
    # own steps, from the second on: the first frame opens the link) and below it.
    assert settled(ports[1], last.completion_tokens - 1) >= last.completion_tokens - 1
    assert settled(ports[0], last.completion_tokens - 2) >= last.completion_tokens - 2
    assert_no_active_sessions(pipeline.configs)

    # Seeded sampling and penalties are the Python path's: the count stays; the text is the one a
    # pipeline without the native path gives.
    before = native_count(ports[1])
    off_ports = free_ports("127.0.0.1", 2)
    python_only = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, metrics_port=off_ports,
                                 native_frames=[True, False])
    assert grpc_generate(python_only.head_endpoint, PROMPT, 24)[0] == reference
    for sampling in (pb.SamplingParams(temperature=0.8, seed=11), pb.SamplingParams(repeat_penalty=1.5)):
        assert (grpc_generate(pipeline.head_endpoint, PROMPT, 16, sampling=sampling)[0]
                == grpc_generate(python_only.head_endpoint, PROMPT, 16, sampling=sampling)[0])
    assert native_count(ports[1]) == before
    assert native_count(off_ports[1]) == 0


def test_a_three_stage_pipelines_inner_and_final_stages_both_run_its_decode_frames_natively(
        smollm2, start_pipeline, reference):
    ports = free_ports("127.0.0.1", 3)
    pipeline = start_pipeline(smollm2, [(0, 10), (10, 20), (20, 30)], n_threads=1, metrics_port=ports)
    text, last = grpc_generate(pipeline.head_endpoint, PROMPT, 24)
    assert text == reference
    for port in ports[1:]:
        assert settled(port, last.completion_tokens - 1) >= last.completion_tokens - 1
    assert settled(ports[0], last.completion_tokens - 2) >= last.completion_tokens - 2
    assert_no_active_sessions(pipeline.configs)


def test_a_plain_frame_for_a_session_the_final_stage_does_not_hold_is_refused_by_name(smollm2, start_pipeline):
    """Declined natively, refused by the Python path on the edge's back channel; the stage stays up."""
    ports = free_ports("127.0.0.1", 2)
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, metrics_port=ports)
    grpc_generate(pipeline.head_endpoint, PROMPT, 4)  # the final stage's return link is up
    port = status(str(pipeline.configs[1]["bind_addr"])).frame_port
    link = framing.dial("127.0.0.1", port, creds=Credentials(), purpose=pb.FrameHello.PURPOSE_HOP, stage_id="test",
                        max_message_bytes=1 << 20, timeout_s=5)
    try:
        link.sock.sendall(_message(body("ghost", 5, 1, np.zeros((1, N_EMBD)))))
        kind, reply_body = link.receive()
        reply = framing.parse(kind, reply_body, framing.Kind.HOP_REPLY)
    finally:
        link.close()
    assert reply.code != 0 and "ghost" in reply.message, reply
    assert list(reply.session_ids) == ["ghost"]
    assert grpc_generate(pipeline.head_endpoint, PROMPT, 4)[0]
    assert_no_active_sessions(pipeline.configs)


def _message(hop_request: bytes) -> bytes:
    return framing._HEADER.pack(len(hop_request) + 1, framing.Kind.HOP_REQUEST) + hop_request


def llama_cpp_greedy(logits: np.ndarray) -> int:
    """llama.cpp's own greedy sampler on ``logits``: what the final stage's pick must equal."""
    import ctypes

    import llama_cpp

    data = (llama_cpp.llama_token_data * len(logits))(
        *(llama_cpp.llama_token_data(i, float(x), 0.0) for i, x in enumerate(logits)))
    candidates = llama_cpp.llama_token_data_array(data=data, size=len(logits), selected=-1, sorted=False)
    sampler = llama_cpp.llama_sampler_init_greedy()
    try:
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates))
    finally:
        llama_cpp.llama_sampler_free(sampler)
    return candidates.selected


def test_the_final_stages_greedy_pick_is_llama_cpps_greedy_sampler():
    """The C pick (two passes, vector max) against llama.cpp's sampler: ties go to the first index,
    a NaN never wins but a NaN first logit stands, -0.0 equals 0.0, the largest logit anywhere,
    the tail past the last eight included, any length."""
    rng = np.random.default_rng(7)
    vocab = rng.standard_normal(49152).astype(np.float32)
    tied = vocab.copy()
    tied[[300, 9000, 49151]] = tied.max() + 1.0
    coarse = rng.integers(0, 4, 1000).astype(np.float32)  # many ties of the top value
    scattered_nan = vocab.copy()
    scattered_nan[rng.integers(0, 49152, 50)] = np.nan
    cases = {
        "a vocabulary": vocab, "three tied maxima": tied, "many ties": coarse,
        "the maximum in the tail": np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11.5], dtype=np.float32),
        "the maximum first": np.array([5, 1, 5, 2, 5, 0, 0, 0, 0, 5], dtype=np.float32),
        "one logit": np.array([-3.0], dtype=np.float32),
        "seven logits": np.array([1, 2, 3, 7, 3, 2, 1], dtype=np.float32),
        "NaNs among them": scattered_nan,
        "a NaN first": np.concatenate([[np.nan], vocab[:99]]).astype(np.float32),
        "all NaN": np.full(17, np.nan, dtype=np.float32),
        "all -inf": np.full(9, -np.inf, dtype=np.float32),
        "-0.0 before 0.0": np.array([-1, -0.0, 0.0, -2, 0.0, -0.0, -5, -9, -0.0], dtype=np.float32),
        "+inf twice": np.array([1, np.inf, 3, np.inf, np.nan, 2, 2, 2, 2, 2], dtype=np.float32),
    }
    for name, logits in cases.items():
        assert native_frames._frames.greedy(logits) == llama_cpp_greedy(logits), name
    with pytest.raises(ValueError, match="float32"):
        native_frames._frames.greedy(b"")


# -- the extension's own safety: ownership, GC, waits, descriptors, bookkeeping ---------------------

# A FramePath's arguments with stand-in pointers (nothing dereferences them but ``batch``, copied at
# init): enough to construct one, never to run a frame. Its pointers go in as the capsules
# ``native_frames.capsule`` makes (``raw=True``: as given).
FAKE_ARGS = """
import ctypes, gc, sys, weakref
from skippy_stage.stage import _frames, native_frames
BATCH = ctypes.create_string_buffer(64)

def fake_args(raw=False, **changes):
    args = dict(ctx=1, mem=1, decode=1, logits_ith=1, seq_rm=1, batch=ctypes.addressof(BATCH), pos=1, seq=1, out=1,
                embd=1, capture=0, token=0, n_embd=8, n_vocab=16, n_batch=4, layer_start=1, layer_end=2,
                stage_index=1, equal_split=False, cells_per_lane=64, kv_pool_tokens=64, hop_timeout_s=1.0,
                owner=object(), compute_lock=object(), lanes_lock=object(), sessions={}, resident={}, histories={},
                samplers={}, routes=None, classify=object(), stage_id=b"s")
    args = {k: native_frames.capsule(k, v) if k in native_frames.POINTER_ARGS else v for k, v in args.items()}
    args.update(changes if raw else
                {k: native_frames.capsule(k, v) if k in native_frames.POINTER_ARGS else v for k, v in changes.items()})
    return args

def lone_args(**changes):
    args = dict(wait=_frames.ReturnWait(n_vocab=16), template=b"", request_id=b"r", key_prefix=b"p", position=0,
                token=1, draws=0, limit=1, eog=b"", timeout_s=1.0, sock=None, send_lock=None,
                gate_pass=_frames.Gate(), stage=None, downstream=None, link=None, on_token=None, bell=None)
    args.update(changes)
    return args
"""


def run_isolated(script: str) -> str:
    """``script`` (after FAKE_ARGS) in a child interpreter, so a crash fails this test and not the run;
    its stdout."""
    done = subprocess.run([sys.executable, "-c", FAKE_ARGS + textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


def test_a_frame_path_refused_at_init_or_initialised_twice_holds_exactly_what_it_took():
    """Arguments are owned only once checked: a refused init (bad sizes, a wrong type) leaves nothing
    for dealloc to release; a second init releases what the first took."""
    out = run_isolated("""
        owner, routes = object(), object()
        for bad in (dict(n_embd=0), dict(sessions=[]), dict(hop_timeout_s=float("nan")), dict(n_embd=1 << 24)):
            try:
                _frames.FramePath(**fake_args(owner=owner, **bad))
            except (ValueError, TypeError):
                pass
            else:
                raise SystemExit(f"accepted {bad}")
            gc.collect()
        base = sys.getrefcount(owner), sys.getrefcount(routes)
        path = _frames.FramePath(**fake_args(owner=owner, capture=1, routes=routes))
        held = sys.getrefcount(owner), sys.getrefcount(routes)
        path.__init__(**fake_args(capture=1, routes=object()))
        assert (sys.getrefcount(owner), sys.getrefcount(routes)) == base, (base, held)
        try:
            path.__init__(**fake_args(n_vocab=0))
        except ValueError:
            pass
        del path
        gc.collect()
        assert (sys.getrefcount(owner), sys.getrefcount(routes)) == base
        try:
            _frames.FramePath.__new__(_frames.FramePath).run(b"", None, None, None)
        except RuntimeError as exc:
            print(exc)
    """)
    assert "not initialised" in out


def test_a_frame_path_in_a_reference_cycle_is_collected():
    """It holds the stage's objects (``routes`` leads back to the stage that holds the path): the
    cycle collector must see through it, or every reloaded stage leaks."""
    run_isolated("""
        class Routes:
            pass
        routes = Routes()
        routes.path = _frames.FramePath(**fake_args(capture=1, routes=routes))
        gone = weakref.ref(routes)
        wait = _frames.ReturnWait(n_vocab=4)
        del routes
        gc.collect()
        assert gone() is None, "the cycle through the FramePath was not collected"
        assert gc.is_tracked(wait)
    """)


def test_a_frame_path_takes_its_pointers_only_as_the_capsules_named_for_them():
    """A raw address, None for a pointer it needs, another argument's capsule or any other capsule is a
    TypeError naming the argument, never a pointer dereferenced (the child would crash)."""
    out = run_isolated("""
        import datetime  # its C API is a capsule of another name
        other = native_frames.capsule("mem", 1)
        for bad in (dict(ctx=1), dict(ctx=None), dict(ctx=other), dict(batch=datetime.datetime_CAPI),
                    dict(decode=object()), dict(capture=b"x")):
            try:
                _frames.FramePath(**fake_args(raw=True, **bad))
            except TypeError as exc:
                print(exc)
            else:
                raise SystemExit(f"accepted {bad}")
        _frames.FramePath(**fake_args(raw=True, logits_ith=None, capture=native_frames.capsule("capture", 1),
                                      routes=object()))  # an inner stage: None where it has no pointer
        assert native_frames.capsule("embd", 0) is None
    """)
    lines = out.splitlines()
    assert len(lines) == 6, out
    assert 'ctx must be a capsule named "skippy_stage._frames.ctx", not int' in lines[0]
    assert "not NoneType" in lines[1]
    assert 'not one named "skippy_stage._frames.mem"' in lines[2]
    assert 'batch must be a capsule named "skippy_stage._frames.batch", not one named "datetime.datetime_CAPI"' in lines[3]
    assert "decode must be" in lines[4] and 'capture must be a capsule named "skippy_stage._frames.capture" or None' \
        in lines[5]


def test_lone_takes_keyword_arguments_only_and_refuses_one_it_does_not_know():
    """Eighteen arguments by position are one swap away from a wrong one: each is named, and a name
    the loop does not know is a TypeError before anything runs."""
    out = run_isolated("""
        head = _frames.FramePath(**fake_args(capture=1, token=1, embd=0))
        misnamed = lone_args(bel=None)  # a misspelt bell
        del misnamed["bell"]
        for call in (lambda: head.lone(**misnamed), lambda: head.lone(*lone_args().values()),
                     lambda: head.lone(**{k: v for k, v in lone_args().items() if k != "on_token"})):
            try:
                call()
            except TypeError as exc:
                print(exc)
            else:
                raise SystemExit("accepted")
    """)
    lines = out.splitlines()
    assert len(lines) == 3, out
    assert "'bel' is an invalid keyword argument for lone()" in lines[0]
    assert "keyword arguments only (18 positional given)" in lines[1]
    assert "on_token" in lines[2]


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, -1.0])
def test_every_wait_refuses_a_timeout_that_is_not_finite_and_non_negative(timeout):
    """A NaN deadline makes pthread_cond_timedwait fail with EINVAL, at once, forever: a wait that
    only left on a timeout spun holding its mutex (and froze the interpreter behind it)."""
    out = run_isolated(f"""
        timeout = float("{timeout}")
        bell, gate = _frames.Bell(), _frames.Gate()
        for call in (bell.wait, gate.close, gate.wait_idle):
            try:
                call(timeout)
            except ValueError as exc:
                print(exc)
            else:
                raise SystemExit(f"{{call}} took {{timeout}}")
        head = _frames.FramePath(**fake_args(capture=1, token=1, embd=0))
        try:
            head.lone(**lone_args(timeout_s=timeout, gate_pass=gate))
        except ValueError as exc:
            print(exc)
    """)
    assert out.count("timeout_s must be finite and >= 0") == 4, out
    assert _frames_module().Bell().wait(0.0) is False  # a finite one still waits (here: not at all)


def _frames_module():
    return native_frames._frames


def test_a_c_reader_never_reads_a_descriptor_number_handed_to_another_socket():
    """The reader reads without the GIL while Python may close its link: it reads its own duplicate
    of the descriptor, so a number closed and handed to a new socket meanwhile is never read."""
    ours, theirs = socket.socketpair()
    reader = native_frames._frames.FrameReader(theirs.fileno(), 1 << 16, b"")
    number = theirs.fileno()
    ours.close()
    theirs.close()
    pairs = [socket.socketpair() for _ in range(4)]  # the lowest free numbers: one of them is ``number``
    try:
        for a, b in pairs:
            for sock, peer in ((a, b), (b, a)):
                if sock.fileno() == number:
                    peer.sendall(framing.encode(framing.Kind.HOP_REQUEST, pb.HopRequest(hop_id=9)))
        assert reader.next(None) is None  # the old link's end, not the new socket's frame
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_closing_a_link_waits_for_the_send_under_way():
    """The C path sends on the raw descriptor holding the send lock: ``close`` shuts the link down
    at once (a blocked send ends) but closes the descriptor only under that lock."""
    ours, theirs = socket.socketpair()
    link = framing.FrameSocket(theirs, max_message_bytes=1 << 16)
    closed = threading.Event()

    def close() -> None:
        link.close()
        closed.set()
    with link.send_lock:
        closer = threading.Thread(target=close, daemon=True)
        closer.start()
        assert ours.recv(1) == b""  # shut down already: the peer sees the end
        assert not closed.is_set() and theirs.fileno() >= 0
    assert closed.wait(10) and theirs.fileno() == -1
    ours.close()


@pytest.mark.parametrize("breakage", ["a lane count that is not an int", "a history that is not a list"])
def test_bookkeeping_that_fails_after_the_decode_leaves_the_session_as_it_was(chain, native, link, breakage):
    """After a successful decode the history and the lane advance together, or (an error raised) the
    history, the lane and the KV the decode wrote are as they were: the same frame then runs again
    and gives the Python path's token."""
    head, tail = chain.stages
    pos, token = prefill(chain, "py")
    assert prefill(chain, "bk") == (pos, token)
    try:
        row = head_rows(head, "h-py", [pos], [token])
        expected = tail.run_batch([BatchEntry("py", np.asarray([pos]), token_ids=np.asarray([token]), hidden=row,
                                              sample=True, sampling=SamplingParams())])[0].token
        before = state(tail, "bk")
        lane = tail.lanes._sessions["bk"]  # the table's own record (lane_of gives a copy)
        if breakage == "a lane count that is not an int":
            lane.batches = str(lane.batches)
        else:
            tail._history["bk"] = tuple(tail._history["bk"])
        with pytest.raises(TypeError):
            native.run(body("bk", pos, token, row), link.ours, link.lock, None)
        lane.batches = int(lane.batches)
        tail._history["bk"] = list(tail._history["bk"])
        assert state(tail, "bk") == before
        assert not link.pending()
        done = native.run(body("bk", pos, token, row), link.ours, link.lock, None)
        assert done is not None and done[0] == 0, done
        assert link.read().response.outputs[0].token == expected
        assert state(tail, "bk") == state(tail, "py")
    finally:
        for session in ("py", "bk"):
            tail.drop_session(session)
        head.drop_session("h-py")
        head.drop_session("h-bk")
