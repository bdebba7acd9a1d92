"""The compiled frame path (``stage/native/*.c``) fuzzed with the real model: mutated frames through
``FramePath.run`` and ``serve`` at the final and an inner stage and through the head's own steps,
mutated returns through ``ReturnWait.take`` (directly and from the C link reader) during the head's
lone generation, mutated streams through the C link reader, and timeouts that are not finite
through every wait.

The seeds are real frames: one session or many (up to 30: 69,120 bytes of rows, over the reader's
64 KiB buffer), prefill-sized ones, 65 entries, empty bodies, timeouts NaN, infinite or negative.
Their mutants (``support/mutations.py``): bytes flipped, cuts, splices of two frames, fields
duplicated, removed, renumbered or given another wire type, lengths set huge, varints extreme or
overlong, at any depth.

What must hold, frame by frame:

- nothing crashes (under the sanitizer build: nothing reported);
- a frame is *declined* (None) and touched nothing — every session's lane length, batch count,
  history and KV cells as they were, no lane taken, no route claimed, nothing sent — or it *runs as a
  valid frame*: one the Python path accepts as it stands (it parses, its checks pass), whose sessions
  advance by exactly one position and one batch (KV and history with them), with a well-formed
  ReturnedBatch or next frame on the link (the entries forwarded byte for byte, the timeout the Python
  path's ``timeout_for`` gives);
- a message ``serve`` hands back is the one sent, byte for byte;
- a stream read in C gives what the Python reader gives (messages, refusal, end), whether it comes
  whole or in random chunks down to single bytes;
- a return the lone loop takes is one plain token for the step it answers, and that token is what the
  next step feeds;
- every wait refuses a timeout that is not finite and >= 0, and returns at once on any other when
  there is nothing to wait for;
- at the end no session, lane, KV cell or history is left.

``SKIPPY_FUZZ_CASES`` sets the cases per target (default 400: the file takes under a minute on 2
cores) and ``SKIPPY_FUZZ_SEED`` the seed (default: a fresh one each run); each target prints both
with its counts, so a failure replays with the same two. Under the sanitizer build (docs/architecture.md,
"Building with sanitizers") a large count is the native path's fuzz run.
"""

from __future__ import annotations

import math
import os
import queue
import random
import secrets
import socket
import struct
import threading
import time

import llama_cpp
import numpy as np
import pytest
from support.frames import N_EMBD, PROMPT, SINK, Below, Edge, load_chain, lone, lone_entry, returned
from support.mutations import DOUBLES, Mutator, fields

from skippy_stage.errors import InvalidRequestError
from skippy_stage.model.batch import check_batch
from skippy_stage.model.runtime import BatchEntry, StageRuntime
from skippy_stage.model.sampling import SamplingParams
from skippy_stage.stage import codec, framing, native_frames
from skippy_stage.stage.codec import sampling_to_pb
from skippy_stage.stage.downstream import timeout_for
from skippy_stage.stage.steps import StageShape, runtime_entries
from skippy_stage.stage.upstream import Routes
from skippy_stage.v1 import stage_pb2 as pb

CASES = int(os.environ.get("SKIPPY_FUZZ_CASES") or 400)
SEED = int(os.environ.get("SKIPPY_FUZZ_SEED") or secrets.randbits(32))
LANES = 32
SESSIONS = 30  # a frame of all of them: 30 rows of 576 float32s, 69,120 bytes
HOP_TIMEOUT_S = 2.5
MAX_MESSAGE_BYTES = 1 << 20
DEADLINE_S = 30.0  # for anything a fuzz case waits on: a case that outlasts it failed
COVERED = CASES >= 200  # enough cases that each kind of outcome must have come up

_frames = native_frames._frames
pytestmark = pytest.mark.skipif(_frames is None, reason=native_frames.available())


def rng_for(target: str) -> random.Random:
    """The target's own generator: each replays alone from the seed."""
    return random.Random(f"{SEED}:{target}")


def report(capsys, target: str, counts: dict[str, int]) -> None:
    with capsys.disabled():
        shown = ", ".join(f"{v} {k}" for k, v in counts.items())
        print(f"\nframe fuzz {target}: {shown} (SKIPPY_FUZZ_SEED={SEED} SKIPPY_FUZZ_CASES={CASES})")


def replay(target: str, case: int) -> str:
    return f"{target} case {case}: replay with SKIPPY_FUZZ_SEED={SEED} SKIPPY_FUZZ_CASES={CASES}"


@pytest.fixture(scope="module")
def chain3(smollm2, slice_cache):
    """test_native_frames' three stages with 32 lanes, so that a frame of 29 sessions or more (over 64 KiB
    of rows) runs; in one KV pool (``kv_unified``), so that frames of several sessions run in C at the
    inner stage and the head too (with a lane each, llama.cpp splits such a batch by sequence and those
    stages leave it to Python). The shared fixtures built on ``chain3`` (``head_path``) take this one."""
    yield from load_chain(smollm2, slice_cache, [(0, 10), (10, 20), (20, 30)], lane_count=LANES,
                          ctx_size=LANES * 128, kv_unified=True)


@pytest.fixture(scope="module")
def prompt(chain3) -> tuple[list[int], dict[int, np.ndarray]]:
    """The prompt's tokens, and its rows as the head and the inner stage send them on (by the layer
    they end at): real hidden states for the frames below the head."""
    head, middle, _ = chain3.stages
    tokens = head.tokenizer.tokenize(PROMPT)
    positions = np.arange(len(tokens))
    at10 = head.run_batch([BatchEntry("rows", positions, token_ids=np.asarray(tokens))])[0].hidden
    at20 = middle.run_batch([BatchEntry("rows", positions, token_ids=np.asarray(tokens), hidden=at10)])[0].hidden
    head.drop_session("rows")
    middle.drop_session("rows")
    return tokens, {10: at10, 20: at20}


class Claims(Routes):
    """An inner stage's routes, counting the keys claimed: a declined frame claims none."""

    def __init__(self) -> None:
        super().__init__()
        self.claimed = 0

    def claim(self, key: str, sink, hop_id: int) -> str:
        self.claimed += 1
        return super().claim(key, sink, hop_id)


def kv_cells(mem: int, lane: int) -> int:
    """The KV cells llama.cpp holds for ``lane``'s sequence (its last position + 1)."""
    return int(llama_cpp.llama_memory_seq_pos_max(mem, lane)) + 1


def assert_nothing_left(runtime: StageRuntime) -> None:
    """No session, lane, KV cell or history held: every lane free (or idle, reset), none discarded."""
    stats = runtime.stats()
    assert stats.active_sessions == 0 and not stats.resident, stats
    assert stats.free_lanes + stats.idle_lanes == stats.lane_count and stats.discarded_lanes == 0, stats
    args = runtime.native_frame_args()
    assert not args["sessions"] and not args["histories"]
    assert [kv_cells(args["mem"], lane) for lane in range(stats.lane_count)] == [0] * stats.lane_count


class Target:
    """One stage's C path under fuzz, its sessions, and the oracle: what a frame run there must have
    done. ``sink``: the link the frames come on, which owns the sessions (None at the head)."""

    def __init__(self, runtime: StageRuntime, path, *, prompt, sink, routes: Claims | None = None,
                 stage_id: str) -> None:
        cfg = runtime.config
        self.runtime, self.path, self.sink, self.routes, self.stage_id = runtime, path, sink, routes, stage_id
        self.kind = "head" if cfg.include_embeddings else "final" if cfg.include_output else "inner"
        self.head, self.final = self.kind == "head", self.kind == "final"
        self.shape = StageShape(stage_id=cfg.stage_id, stage_index=cfg.stage_index, layer_start=cfg.layer_start,
                                layer_end=cfg.layer_end, n_embd=runtime.n_embd, include_embeddings=cfg.include_embeddings,
                                include_output=cfg.include_output, wire_dtype=cfg.wire_dtype)
        args = runtime.native_frame_args()
        self.mem, self.histories = args["mem"], args["histories"]
        self.n_vocab = runtime.n_vocab
        self.tokens, rows = prompt
        self.rows = None if self.head else rows[cfg.layer_start]
        # One id of the longest length a session may have (256 ASCII characters).
        self.sessions = [f"{self.kind}-{i:02d}" for i in range(SESSIONS - 1)] + ["long-" + "x" * 251]
        lanes = runtime.lanes
        self.full = min(lanes.cells_per_lane, lanes.kv_pool_tokens // len(self.sessions)) - 2
        # An inner stage's keys claimed by the frames of one delivery: a frame whose key one of them
        # holds gets a fresh one (``Routes.claim``).
        self.routed: set[str] = set()
        self.bind(self.sessions)

    # -- sessions ---------------------------------------------------------------------------------

    def bind(self, sessions: list[str]) -> None:
        """``sessions`` opened here with the prompt, as the Python path opens them."""
        n = len(self.tokens)
        per = self.runtime.config.n_batch // n
        for i in range(0, len(sessions), per):
            self.runtime.run_batch([
                BatchEntry(s, np.arange(n), token_ids=np.asarray(self.tokens), hidden=self.rows, sample=self.final,
                           sampling=SamplingParams() if self.final else None)
                for s in sessions[i:i + per]], self.sink)

    def rotate(self) -> None:
        """Sessions near the end of their lane start over (dropped, opened again)."""
        full = [s for s in self.sessions if self.runtime.lanes.lane_of(s).n_tokens >= self.full]
        for s in full:
            self.runtime.drop_session(s)
        if full:
            self.bind(full)

    def drop_all(self) -> None:
        for s in self.sessions:
            if self.runtime.lanes.lane_of(s) is not None:
                self.runtime.drop_session(s)

    def snapshot(self) -> dict:
        """Everything a frame may change here: per session its lane, length, batches, KV cells and
        history; the lane table's counts; the routes claimed."""
        lanes = self.runtime.lanes
        out: dict = {}
        for s in self.sessions:
            lane = lanes.lane_of(s)
            out[s] = (lane.lane, lane.n_tokens, lane.batches, kv_cells(self.mem, lane.lane),
                      tuple(self.histories.get(s, ())))
        stats = self.runtime.stats()
        out["lanes"] = (stats.active_sessions, stats.idle_lanes, stats.free_lanes, stats.discarded_lanes)
        out["claims"] = None if self.routes is None else self.routes.claimed
        return out

    # -- frames -----------------------------------------------------------------------------------

    def frame(self, rng: random.Random, sessions: list[str], state: dict, *, request_id: str | None = None) -> bytes:
        """A frame this stage's C path runs: ``sessions`` each at its next position (``state``)."""
        entries = []
        for s in sessions:
            pos = state[s][1]
            entry = pb.BatchEntry(session_id=s, phase=pb.PHASE_DECODE, positions=[pos], sample_last=True,
                                  sampling=sampling_to_pb(None), draws_before=rng.randint(0, pos))
            if self.head or rng.random() < 0.8:
                entry.token_ids.append(rng.randrange(self.n_vocab))
            entries.append(entry)
        if request_id is None:
            request_id = "".join(rng.choice("abcxyz-0123456789") for _ in range(rng.randrange(12)))
        key_len = rng.randint(0 if self.kind == "inner" else 1, 64)
        request = pb.IterationBatchRequest(request_id=request_id, entries=entries,
                                           return_key=secrets.token_hex(32)[:key_len])
        if not self.head:
            rows = self.rows[[rng.randrange(len(self.rows)) for _ in sessions]]
            payload = np.ascontiguousarray(rows, dtype=np.float32).tobytes()
            cfg = self.runtime.config
            request.frame.descriptor.CopyFrom(pb.FrameDescriptor(
                version=1, dtype=pb.DTYPE_F32, layout=pb.LAYOUT_TOKEN_MAJOR, producer_stage_index=cfg.stage_index - 1,
                layer_start=cfg.layer_start - 10, layer_end=cfg.layer_start, token_count=len(sessions),
                sequence_count=len(sessions), payload_bytes=len(payload), width=N_EMBD))
            request.frame.payload = payload
        hop = pb.HopRequest(hop_id=rng.getrandbits(64), request=request, timeout_s=rng.choice(DOUBLES),
                            relay=not self.final and rng.random() < 0.2)
        if rng.random() < 0.8:
            hop.sent_unix_ns = time.time_ns()
        return hop.SerializeToString()

    def seed_frame(self, rng: random.Random, state: dict) -> bytes:
        """A frame to run or mutate: of one session, several, or all 30 (over 64 KiB of rows, and of
        the head's next frame); now and then one the C path declines as it stands (prefill-sized,
        more entries than a batch holds, no bytes at all) or one over 64 KiB by its request id."""
        roll = rng.random()
        if roll < 0.03:
            return b""
        if roll < 0.06:  # a prefill of 40 positions: 92,160 bytes of rows
            return self.prefill_frame(rng, state)
        if roll < 0.08:  # 65 entries, one more than a batch may hold
            return self.frame(rng, [f"nobody-{i}" for i in range(65)], {f"nobody-{i}": (0, 0) for i in range(65)})
        if roll < 0.10:
            return self.frame(rng, rng.sample(self.sessions, 2), state, request_id="r" * 70_000)
        k = rng.choice((1, 1, 1, 2, 3, 4, rng.randint(5, 28), SESSIONS - 1, SESSIONS))
        return self.frame(rng, rng.sample(self.sessions, k), state)

    def prefill_frame(self, rng: random.Random, state: dict) -> bytes:
        s = rng.choice(self.sessions)
        pos = state[s][1]
        n = 40
        entry = pb.BatchEntry(session_id=s, phase=pb.PHASE_PREFILL, positions=range(pos, pos + n),
                              token_ids=[rng.randrange(self.n_vocab) for _ in range(n)], sample_last=True,
                              sampling=sampling_to_pb(None))
        request = pb.IterationBatchRequest(request_id="prefill", entries=[entry], return_key="k")
        if not self.head:
            payload = np.resize(self.rows, (n, N_EMBD)).astype(np.float32).tobytes()
            cfg = self.runtime.config
            request.frame.descriptor.CopyFrom(pb.FrameDescriptor(
                version=1, dtype=pb.DTYPE_F32, layout=pb.LAYOUT_TOKEN_MAJOR, layer_start=cfg.layer_start - 10,
                layer_end=cfg.layer_start, token_count=n, sequence_count=1, payload_bytes=len(payload), width=N_EMBD))
            request.frame.payload = payload
        return pb.HopRequest(request=request).SerializeToString()

    def case(self, rng: random.Random, mutator: Mutator, state: dict) -> bytes:
        """One case's frame: a seed as it stands (a fifth of them), else a mutant of one."""
        seed = self.seed_frame(rng, state)
        if rng.random() < 0.2:
            return seed
        return mutator.mutate(seed, [self.seed_frame(rng, state)])

    # -- the oracle -------------------------------------------------------------------------------

    def expect(self, sent: bytes, done: tuple | None, before: dict, link, where: str) -> dict:
        """What ``sent`` must have done here, given the C path's answer ``done`` (``run``'s; None:
        declined): the state after it. A frame that ran must be one the Python path accepts, and its
        output is read off ``link`` and checked."""
        if done is None:
            return before
        status, rc, _, _, n, payload_bytes, message, _, key = done
        assert (status, rc, message) == (0, 0, None), (where, done)
        try:
            hop = pb.HopRequest.FromString(sent)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError: the C path ran what Python cannot parse
            raise AssertionError(f"{where}: ran a frame that does not parse: {exc}") from None
        try:
            assert codec.released_from_pb(hop) is None
            checked = runtime_entries(codec.frame_from_pb(hop).step, self.shape)
            with np.errstate(over="ignore"):  # rows of huge finite values: their sum overflows, and is checked on
                check_batch(checked, self.runtime.config, n_vocab=self.n_vocab, n_embd=self.runtime.n_embd,
                            cuttable=self.runtime.cuttable)
        except Exception as exc:  # noqa: BLE001 - InvalidRequestError, or whatever else the Python path raises
            raise AssertionError(f"{where}: ran a frame the Python path refuses: {exc!r}") from None
        entries = hop.request.entries
        assert n == len(entries) and payload_bytes == len(hop.request.frame.payload), where
        after = dict(before)
        if self.final:
            sampled = self.read_returned(hop, link, where)
            assert key is None, where
        else:
            sampled = [None] * n
            self.read_forwarded(sent, hop, key, link, where)
        for e, token in zip(entries, sampled):
            lane, n_tokens, batches, cells, history = before[e.session_id]
            pos = e.positions[0]
            assert pos == n_tokens == cells, (where, e.session_id, before[e.session_id])
            if self.final:
                fed = list(e.token_ids)
                cut = pos if fed and pos < len(history) else len(history)
                history = history[:cut] + tuple(fed) + (token,)
            after[e.session_id] = (lane, n_tokens + 1, batches + 1, cells + 1, history)
        if self.routes is not None:
            after["claims"] = before["claims"] + 1
        return after

    def read_returned(self, hop: pb.HopRequest, link, where: str) -> list[int]:
        """The final stage's ReturnedBatch for ``hop``: its key, one plain token per entry in entry
        order, this stage's id; the tokens."""
        kind, raw = link.head.receive()
        back = framing.parse(kind, raw, framing.Kind.RETURNED_BATCH)
        assert back.return_key == hop.request.return_key and back.response.final_stage_id == self.stage_id, where
        outputs = back.response.outputs
        assert [o.session_id for o in outputs] == [e.session_id for e in hop.request.entries], where
        for o in outputs:
            assert {f.name for f, _ in o.ListFields()} <= {"session_id", "has_token", "token"}, (where, o)
            assert o.has_token and 0 <= o.token < self.n_vocab, (where, o)
        return [o.token for o in outputs]

    def read_forwarded(self, sent: bytes, hop: pb.HopRequest, key: str | None, link, where: str) -> None:
        """The next frame for ``hop`` (bytes ``sent``): the entries as they came, byte for byte; rows
        computed here for each; the return key (an inner stage's routed to the link it came on); the
        timeout the Python path gives."""
        kind, raw = link.head.receive()
        forwarded = framing.parse(kind, raw, framing.Kind.HOP_REQUEST)
        request = forwarded.request
        assert raw_entries(raw) == raw_entries(sent), where
        assert request.request_id == hop.request.request_id, where
        if self.head:
            assert key is None and request.return_key == hop.request.return_key, where
        else:
            asked = hop.request.return_key
            fresh = not asked or asked in self.routed
            assert request.return_key == key and (len(key) == 32 if fresh else key == asked), (where, asked, key)
            assert self.routes.take(key) == (self.sink, hop.hop_id), where
            self.routed.add(key)
        expected = timeout_for(hop.timeout_s or None, HOP_TIMEOUT_S)
        assert struct.pack("<d", forwarded.timeout_s) == struct.pack("<d", expected), (where, hop.timeout_s)
        assert forwarded.relay == hop.relay and forwarded.hop_id == 0 and forwarded.sent_unix_ns > 0, where
        n = len(hop.request.entries)
        d = request.frame.descriptor
        cfg = self.runtime.config
        assert (d.version, d.dtype, d.layout, d.producer_stage_index, d.layer_start, d.layer_end, d.width,
                d.token_count, d.sequence_count, d.payload_bytes) == (
            1, pb.DTYPE_F32, pb.LAYOUT_TOKEN_MAJOR, cfg.stage_index, cfg.layer_start, cfg.layer_end, N_EMBD, n, n,
            n * 4 * N_EMBD), where
        rows = np.frombuffer(request.frame.payload, dtype=np.float32)
        assert rows.size == n * N_EMBD, where
        came = np.frombuffer(hop.request.frame.payload, dtype=np.float32)
        if not came.size or np.abs(came).max() < 1e4:  # rows of huge values may well come out non-finite
            assert np.isfinite(rows).all(), where


def raw_entries(hop_request: bytes) -> list[bytes]:
    """A HopRequest's BatchEntry fields as they are on the wire."""
    request = [f for f in fields(hop_request) if f.number == 2]
    assert len(request) == 1
    return [f.value for f in fields(request[0].value) if f.number == 2]


def make_target(kind: str, chain3, head_path, prompt) -> Target:
    head, middle, final = chain3.stages
    if kind == "head":
        return Target(head, head_path, prompt=prompt, sink=None, stage_id="stage-head")
    if kind == "inner":
        routes = Claims()
        path = native_frames.frame_path(middle.native_frame_args(), hop_timeout_s=HOP_TIMEOUT_S, routes=routes,
                                        stage_id=b"stage-mid")
        return Target(middle, path, prompt=prompt, sink=SINK, routes=routes, stage_id="stage-mid")
    path = native_frames.frame_path(final.native_frame_args(), hop_timeout_s=HOP_TIMEOUT_S, routes=None,
                                    stage_id=b"stage-final")
    return Target(final, path, prompt=prompt, sink=SINK, stage_id="stage-final")


# -- FramePath.run ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["final", "inner", "head"])
def test_mutated_frames_are_declined_untouched_or_run_as_valid_frames(kind, chain3, head_path, prompt, link, capsys):
    """Seed frames and their mutants through ``run``: each declined with nothing touched, or run as a
    valid frame (the module docstring says what that checks); nothing left behind at the end."""
    target = make_target(kind, chain3, head_path, prompt)
    name = f"run/{kind}"
    rng = rng_for(name)
    mutator = Mutator(rng, pb.HopRequest.DESCRIPTOR)
    counts = {"cases": 0, "ran": 0, "declined": 0, "over 64 KiB": 0, "ran over 64 KiB": 0}
    try:
        for case in range(CASES):
            where = replay(name, case)
            target.rotate()
            target.routed.clear()
            before = target.snapshot()
            sent = target.case(rng, mutator, before)
            done = target.path.run(sent, link.ours, link.lock, target.sink)
            after = target.expect(sent, done, before, link, where)
            assert target.snapshot() == after, where
            assert not link.pending(), where
            counts["cases"] += 1
            counts["ran" if done is not None else "declined"] += 1
            big = len(sent) > 1 << 16 or (done is not None and done[4] * 4 * N_EMBD > 1 << 16)
            counts["over 64 KiB"] += big
            counts["ran over 64 KiB"] += big and done is not None
    finally:
        report(capsys, name, counts)
        target.drop_all()
    assert_nothing_left(target.runtime)
    assert not COVERED or (counts["ran"] and counts["declined"] and counts["ran over 64 KiB"]), counts


# -- FramePath.serve ----------------------------------------------------------------------------


class Served:
    """A stage's frame link read and run in C (``FramePath.serve``) on a thread, as the listener runs
    it; what it did with each message comes back as events: ("end", done, body) for ``end``,
    ("handed", got) for a message handed back (None once the link ended), ("raised", exc)."""

    def __init__(self, target: Target, link) -> None:
        self.target, self.link = target, link
        self.upstream, self.ours = socket.socketpair()
        self.reader = _frames.FrameReader(self.ours.fileno(), MAX_MESSAGE_BYTES, b"")
        self.events: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while True:
                got = self.target.path.serve(self.reader, self._begin, self._end, self.target.sink)
                self.events.put(("handed", got))
                if got is None or got[0] < 0:
                    return  # the end, or a length it cannot read past: the link is closed
        except BaseException as exc:  # noqa: BLE001 - the test's to raise
            self.events.put(("raised", exc))

    def _begin(self):
        return self.link.ours, self.link.lock, "held"

    def _end(self, held, done, body, sink) -> None:
        self.events.put(("end", done, body, held[2] == "held" and sink is self.target.sink))

    def outcome(self, where: str) -> tuple[str, object]:
        """What became of the next message: ("ran", done) or ("handed", got)."""
        event = self.events.get(timeout=DEADLINE_S)
        if event[0] == "end":
            _, done, body, passed = event
            assert passed, where
            if done is not None:
                assert body is None, where  # a plain success: the frame's bytes are not asked for
                return "ran", done
            event = self.events.get(timeout=DEADLINE_S)  # declined inside the run: handed back after
        if event[0] == "raised":
            raise event[1]
        return "handed", event[1]

    def close(self) -> None:
        self.upstream.close()
        self.thread.join(DEADLINE_S)
        self.ours.close()


def deliver(sock: socket.socket, data: bytes, rng: random.Random) -> None:
    """``data`` sent whole, or in random pieces (single bytes among them), pausing now and then so a
    reader waiting on the socket sees them apart."""
    if rng.random() < 0.4:
        sock.sendall(data)
        return
    i = 0
    pauses = 8
    while i < len(data):
        size = rng.choice((1, 1, 2, 3, 5, rng.randint(1, 64), rng.randint(1, 4096), rng.randint(1, 1 << 17)))
        sock.sendall(data[i:i + size])
        i += size
        if pauses and rng.random() < 0.2:
            pauses -= 1
            time.sleep(0.0002)


def header(length: int, kind: int) -> bytes:
    return struct.pack(">IB", length, kind)


@pytest.mark.parametrize("kind", ["final", "inner"])
def test_a_served_link_runs_or_hands_back_each_mutated_message_as_it_came(kind, chain3, head_path, prompt, link,
                                                                          capsys):
    """Each message on the link: run as a valid frame, or handed back byte for byte (with nothing
    touched); one with more behind it, of another kind, or with a length it cannot read past (zero,
    over max_message_bytes) handed back as ``next`` gives it, and a link cut mid-message ended."""
    target = make_target(kind, chain3, head_path, prompt)
    name = f"serve/{kind}"
    rng = rng_for(name)
    mutator = Mutator(rng, pb.HopRequest.DESCRIPTOR)
    counts = {"cases": 0, "ran": 0, "handed back": 0, "links": 1, "refused lengths": 0, "cut": 0}
    served = Served(target, link)
    try:
        for case in range(CASES):
            where = replay(name, case)
            target.rotate()
            target.routed.clear()
            before = target.snapshot()
            roll = rng.random()
            if roll < 0.04:  # a length it cannot read past: refused, then the link is closed
                length = rng.choice((0, MAX_MESSAGE_BYTES + 2, 2**32 - 1))
                deliver(served.upstream, header(length, framing.Kind.HOP_REQUEST) + b"\x12\x00", rng)
                how, got = served.outcome(where)
                why = ("frame message length is 0 (it must include the kind byte)" if length == 0 else
                       f"frame message of {length - 1} bytes exceeds max_message_bytes={MAX_MESSAGE_BYTES}")
                assert (how, got) == ("handed", (-1, why)), where
                counts["refused lengths"] += 1
            elif roll < 0.07:  # the link cut mid-message
                body = target.case(rng, mutator, before)
                message = header(len(body) + 1, framing.Kind.HOP_REQUEST) + body
                deliver(served.upstream, message[:rng.randrange(len(message))], rng)
                served.upstream.shutdown(socket.SHUT_WR)
                assert served.outcome(where) == ("handed", None), where
                counts["cut"] += 1
            else:
                count = 2 if rng.random() < 0.1 else 1  # two at once: the first has another behind it
                sent = []
                for _ in range(count):
                    kind_byte = framing.Kind.HOP_REQUEST if rng.random() < 0.9 else rng.choice((1, 2, 4, 5, 0, 255))
                    sent.append((kind_byte, target.case(rng, mutator, before)))
                deliver(served.upstream, b"".join(header(len(b) + 1, k) + b for k, b in sent), rng)
                outcomes = [served.outcome(where) for _ in sent]
                after = before
                for (kind_byte, body), (how, got) in zip(sent, outcomes):
                    if how == "ran":
                        assert kind_byte == framing.Kind.HOP_REQUEST, where
                        after = target.expect(body, got, after, link, where)
                        counts["ran"] += 1
                    else:
                        assert got == (kind_byte, body), where
                        counts["handed back"] += 1
                assert target.snapshot() == after, where
                assert not link.pending(), where
                counts["cases"] += count
                continue
            assert target.snapshot() == before, where
            served.close()
            served = Served(target, link)
            counts["links"] += 1
            counts["cases"] += 1
    finally:
        served.close()
        report(capsys, name, counts)
        target.drop_all()
    assert_nothing_left(target.runtime)
    assert not COVERED or (counts["ran"] and counts["handed back"]), counts


# -- the C link reader ----------------------------------------------------------------------------


def seeds_for_streams(rng: random.Random) -> list[bytes]:
    """Messages to mutate into a stream: frames of one and of 30 sessions (69 KiB), a returned token,
    a hello, random bytes up to 200 KiB."""
    rows = np.resize(np.linspace(-3, 3, N_EMBD, dtype=np.float32), (SESSIONS, N_EMBD))

    def hop(n: int) -> bytes:
        entries = [pb.BatchEntry(session_id=f"s{i}", positions=[7], token_ids=[9], sample_last=True,
                                 sampling=sampling_to_pb(None)) for i in range(n)]
        payload = rows[:n].tobytes()
        return pb.HopRequest(hop_id=3, timeout_s=1.0, request=pb.IterationBatchRequest(
            request_id="r", return_key="k", entries=entries, frame=pb.ActivationFrame(
                descriptor=pb.FrameDescriptor(version=1, dtype=1, layout=1, layer_end=10, width=N_EMBD, token_count=n,
                                              sequence_count=n, payload_bytes=len(payload)),
                payload=payload))).SerializeToString()
    return [hop(1), hop(SESSIONS), returned("k.0", "s0", 5), pb.FrameHello(stage_id="x").SerializeToString(), b"",
            rng.randbytes(rng.randint(1, 200_000))]


class Stream:
    """``stream`` sent down a socket pair by a thread (``send(sock, stream)``), read at the other end
    (``theirs``). Closing shuts the reading end down first: a sender blocked on a reader that stopped
    (at a refusal) fails instead of waiting."""

    def __init__(self, stream: bytes, send) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.thread = threading.Thread(target=self._send, args=(send, stream), daemon=True)
        self.thread.start()

    def _send(self, send, stream: bytes) -> None:
        try:
            send(self.ours, stream)
            self.ours.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the reader stopped and shut its end down

    def close(self) -> None:
        self.theirs.shutdown(socket.SHUT_RDWR)  # the C reader's duplicate of the descriptor included
        self.thread.join(DEADLINE_S)
        self.ours.close()
        self.theirs.close()


def read_all(receive, most: int | None = None) -> list[tuple]:
    """``receive()``'s messages until the end (("closed", why)), a refusal (("refused", why)) or ``most``."""
    got: list[tuple] = []
    while most is None or len(got) < most:
        try:
            got.append(receive())
        except framing.LinkClosed as exc:
            return [*got, ("closed", str(exc))]
        except InvalidRequestError as exc:
            return [*got, ("refused", str(exc))]
    return got


def python_read(stream: bytes, max_bytes: int) -> list[tuple]:
    """What the Python reader (FrameSocket) gives for ``stream`` sent whole: the reference."""
    link = Stream(stream, lambda sock, data: sock.sendall(data))
    try:
        return read_all(framing.FrameSocket(link.theirs, max_message_bytes=max_bytes).receive)
    finally:
        link.close()


def native_read(stream: bytes, max_bytes: int, rng: random.Random, how: str) -> list[tuple]:
    """What the C reader gives for ``stream`` delivered by ``deliver``: through ``link_reader`` (taking
    over what a first Python receive buffered, now and then), or a raw FrameReader with a lone
    generation's ReturnWait that awaits nothing (every message parsed as a return, none taken)."""
    chunks = random.Random(rng.getrandbits(64))  # the sender thread's own
    link = Stream(stream, lambda sock, data: deliver(sock, data, chunks))
    try:
        if how == "wait":
            wait = _frames.ReturnWait(n_vocab=1 << 16)
            reader = _frames.FrameReader(link.theirs.fileno(), max_bytes, b"")
            return read_all(lambda: native_frames.read(reader, wait))
        python = framing.FrameSocket(link.theirs, max_message_bytes=max_bytes)
        first = read_all(python.receive, 1) if how == "taken over" else []
        if first and first[-1][0] in ("closed", "refused"):
            return first
        return first + read_all(native_frames.link_reader(python).receive)
    finally:
        link.close()


def test_a_stream_read_in_c_gives_the_python_readers_messages_however_it_is_chunked(capsys):
    """Streams of mutated messages (empty bodies, over 64 KiB, any kind byte), ending cleanly, cut
    mid-message, or at a length that cannot be read past (zero, over max_message_bytes): the C reader
    gives what FrameSocket gives, message for message, delivered whole and in random chunks."""
    name = "reader"
    rng = rng_for(name)
    seeds = seeds_for_streams(rng)
    mutators = [Mutator(rng, pb.HopRequest.DESCRIPTOR), Mutator(rng, pb.ReturnedBatch.DESCRIPTOR)]
    counts = {"messages": 0, "streams": 0, "bytes": 0, "over 64 KiB": 0, "refused": 0, "cut": 0}
    while counts["messages"] < CASES:
        where = replay(name, counts["streams"])
        max_bytes = rng.choice((1 << 16, MAX_MESSAGE_BYTES, rng.randint(1, 1 << 17)))
        messages = []
        for _ in range(rng.randint(1, 12)):
            seed = rng.choice(seeds)
            body = seed if rng.random() < 0.2 else rng.choice(mutators).mutate(seed, seeds)
            messages.append(header(len(body) + 1, rng.choice((3, 3, 5, 5, 1, 0, 255))) + body)
            counts["over 64 KiB"] += len(body) > 1 << 16
        stream = b"".join(messages)
        ending = rng.choice(("end", "end", "zero", "over", "cut"))
        if ending == "zero":
            stream += header(0, 3) + b"\x08\x01"
        elif ending == "over":
            stream += header(rng.randint(max_bytes + 2, 2**32 - 1), 3) + b"\x08\x01"
        elif ending == "cut":
            stream += messages[0][:rng.randrange(len(messages[0]))]
        expected = python_read(stream, max_bytes)
        for how in ("link", "taken over", "wait"):
            assert native_read(stream, max_bytes, rng, how) == expected, (where, how)
        counts["messages"] += len(expected)
        counts["streams"] += 1
        counts["bytes"] += len(stream)
        counts["refused"] += expected[-1][0] == "refused"
        counts["cut"] += ending == "cut"
    report(capsys, name, counts)
    assert not COVERED or (counts["refused"] and counts["over 64 KiB"]), counts


# -- the head's lone generation: returns through ReturnWait.take --------------------------------


class ReturnListener:
    """The head's return listener on a link read in C: ``next(wait)`` takes the awaited token on the
    way, every other message is handed back (``handed``)."""

    def __init__(self, wait) -> None:
        self.peer, self.ours = socket.socketpair()
        self.reader = _frames.FrameReader(self.ours.fileno(), MAX_MESSAGE_BYTES, b"")
        self.wait = wait
        self.handed: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while (got := self.reader.next(self.wait)) is not None:
            self.handed.put(got)

    def send(self, body: bytes) -> None:
        self.peer.sendall(header(len(body) + 1, framing.Kind.RETURNED_BATCH) + body)

    def drain(self) -> list[bytes]:
        """Every return handed back since the last drain (a marker sent behind them comes back last)."""
        marker = secrets.token_bytes(8)
        self.peer.sendall(header(len(marker) + 1, framing.Kind.HELLO) + marker)
        back = []
        while (got := self.handed.get(timeout=DEADLINE_S)) != (framing.Kind.HELLO, marker):
            back.append(got[1])
        return back

    def close(self) -> None:
        self.peer.close()
        self.thread.join(DEADLINE_S)
        self.ours.close()


def taken_from(offered: list[bytes], handed: list[bytes]) -> list[bytes]:
    """The offered returns that were not handed back (``handed``: the rest, in order)."""
    taken, rest = [], iter(handed)
    pending = next(rest, None)
    for m in offered:
        if m == pending:
            pending = next(rest, None)
        else:
            taken.append(m)
    assert pending is None, "handed back a return that was not offered"
    return taken


def test_mutated_returns_are_taken_only_as_the_plain_token_of_the_step_they_answer(chain3, head_path, link, capsys):
    """Each step of a lone run is answered with mutated returns, then the true one, through ``take``
    (as the listener's Python would call it) or on a link read in C. Each return taken is one plain
    token for the session under a key of this run's, one per step, and its token is the one the next
    step feeds; the rest are left (handed back). The head's session advances one position a step. A
    timeout that is not finite and >= 0 is refused before anything runs."""
    name = "lone"
    rng, answers = rng_for(name), rng_for(name + "/answers")
    head = chain3.stages[0]
    mem = head.native_frame_args()["mem"]
    n_vocab = head.n_vocab
    tokens = head.tokenizer.tokenize(PROMPT)
    wait = _frames.ReturnWait(n_vocab=n_vocab)
    mutator = Mutator(answers, pb.ReturnedBatch.DESCRIPTOR)
    listener = ReturnListener(wait)
    offered: list[bytes] = []
    taken: list[bytes] = []
    mode = ["take"]
    answered, n_answered = threading.Condition(), [0]  # frames Below has answered in full
    eog = tuple(rng.randrange(n_vocab) for _ in range(3))
    counts = {"returns": 0, "taken": 0, "runs": 0, "steps": 0, "refused timeouts": 0}

    def answer(request) -> None:
        try:
            offer(request)
        finally:
            with answered:
                n_answered[0] += 1
                answered.notify_all()

    def offer(request) -> None:
        key, final_id = request.return_key, final_stage_id(answers)
        token = answers.choice(eog) if answers.random() < 0.05 else answers.randrange(n_vocab)
        true = returned(key, "lone", token)
        if final_id is not None:
            true = pb.ReturnedBatch(return_key=key, response=pb.IterationBatchResponse(
                outputs=[pb.EntryOutput(session_id="lone", has_token=True, token=token)],
                final_stage_id=final_id)).SerializeToString()
        corpus = [true, returned(key, "other", token), returned(key + "x", "lone", token)]
        for m in [mutator.mutate(true, corpus) for _ in range(answers.randint(0, 4))] + [true]:
            offered.append(m)
            if mode[0] == "take":
                if wait.take(m):
                    taken.append(m)
                    return
            else:
                listener.send(m)

    below = Below(link, wait, answer)
    head.run_batch([BatchEntry("lone", np.arange(len(tokens)), token_ids=np.asarray(tokens))])
    try:
        while counts["returns"] < CASES:
            where = replay(name, counts["runs"])
            lane = head.lanes.lane_of("lone")
            if lane.n_tokens >= head.lanes.cells_per_lane - 8:
                head.drop_session("lone")
                head.run_batch([BatchEntry("lone", np.arange(len(tokens)), token_ids=np.asarray(tokens))])
                lane = head.lanes.lane_of("lone")
            pos, fed = lane.n_tokens, rng.randrange(n_vocab)
            frames_before = len(below.frames)
            if rng.random() < 0.05:
                bad = rng.choice((math.nan, math.inf, -math.inf, -1.0, -1e-300))
                with pytest.raises(ValueError, match="finite and >= 0"):
                    lone(head_path, Edge(link), wait, lone_entry("lone"), pos, fed, timeout_s=bad)
                assert head.lanes.lane_of("lone") == lane and not link.pending(), where
                counts["refused timeouts"] += 1
                continue
            mode[0] = rng.choice(("take", "reader"))
            offered.clear()
            taken.clear()
            prefix = secrets.token_hex(8).encode()
            limit = rng.randint(1, 5)
            how, value, steps, computes, hops, final_id = lone(
                head_path, Edge(link), wait, lone_entry("lone"), pos, fed, limit=limit, eog=eog, timeout_s=DEADLINE_S,
                key_prefix=prefix)
            with answered:  # the loop may end before Below has booked the return it took
                assert answered.wait_for(lambda n=frames_before + steps: n_answered[0] >= n, DEADLINE_S), where
            if mode[0] == "reader":
                taken.extend(taken_from(offered, listener.drain()))
            assert how == native_frames.LONE_TOKEN and 1 <= steps <= limit, (where, how, value, steps)
            assert len(computes) == len(hops) == steps == len(taken), (where, steps, len(taken))
            frames = below.frames[frames_before:]
            assert len(frames) == steps, where
            keys = [f"{prefix.decode()}.{j}" for j in range(steps)]
            tokens_by_key, final_ids = {}, {}
            for m in taken:
                back = pb.ReturnedBatch.FromString(m)
                [out] = back.response.outputs
                assert out.session_id == "lone" and out.has_token and 0 <= out.token < n_vocab, (where, back)
                assert {f.name for f, _ in out.ListFields()} <= {"session_id", "has_token", "token"}, (where, back)
                assert back.return_key in keys and back.return_key not in tokens_by_key, (where, back)
                tokens_by_key[back.return_key] = out.token
                final_ids[back.return_key] = back.response.final_stage_id
            feeds = [fed] + [tokens_by_key[k] for k in keys]
            for j, frame in enumerate(frames):
                (entry,) = frame.request.entries
                assert (list(entry.positions), list(entry.token_ids), entry.draws_before) == (
                    [pos + j], [feeds[j]], pos + j), where
                assert frame.request.return_key == keys[j] and frame.request.request_id == (
                    "step-7" if j == 0 else f"step-7+{j}"), where
                rows = np.frombuffer(frame.request.frame.payload, dtype=np.float32)
                assert rows.size == N_EMBD and np.isfinite(rows).all(), where
            assert value == feeds[-1] and (steps == limit or value in eog), where
            assert final_id == final_ids[keys[-1]], where
            assert all(t not in eog for t in feeds[1:-1]), where
            after = head.lanes.lane_of("lone")
            assert (after.n_tokens, after.batches) == (pos + steps, lane.batches + steps), where
            assert kv_cells(mem, after.lane) == pos + steps, where
            counts["returns"] += len(offered)
            counts["taken"] += len(taken)
            counts["runs"] += 1
            counts["steps"] += steps
    finally:
        report(capsys, name, counts)
        link.close()
        below.thread.join(DEADLINE_S)
        listener.close()
        head.drop_session("lone")
    assert_nothing_left(head)


def final_stage_id(rng: random.Random) -> str | None:
    """A final stage's id for a return: the default (None), empty, or up to 256 ASCII characters."""
    roll = rng.random()
    if roll < 0.7:
        return None
    return "f" * rng.choice((0, 1, 255, 256))  # longer is not a plain return: Python's to settle


# -- timed waits ----------------------------------------------------------------------------------


def test_every_wait_refuses_a_timeout_that_is_not_finite_and_returns_on_any_other(capsys):
    """Bell.wait, Gate.close and Gate.wait_idle given every kind of double (random bit patterns among
    them: NaNs, infinities, subnormals, the largest finite): ValueError unless finite and >= 0; any
    other returns at once where there is nothing to wait for, and a short one times out where there is."""
    name = "waits"
    rng = rng_for(name)
    bell, gate = _frames.Bell(), _frames.Gate()
    values = list(DOUBLES) + [struct.unpack("<d", rng.randbytes(8))[0] for _ in range(CASES)]
    counts = {"timeouts": 0, "refused": 0, "timed out": 0}
    for i, value in enumerate(values):
        where = (replay(name, i), value)
        if not (math.isfinite(value) and value >= 0):
            for call in (bell.wait, gate.close, gate.wait_idle):
                with pytest.raises(ValueError, match="finite and >= 0"):
                    call(value)
            counts["refused"] += 1
        else:
            bell.ring()
            assert bell.wait(value) is True, where  # rung: at once, however long it may wait
            assert gate.close(value) is True, where  # none passing
            gate.open()
            assert gate.wait_idle(value) is True, where
            if value <= 0.002:
                assert bell.wait(value) is False, where
                with gate:
                    assert gate.wait_idle(value) is False, where
                    assert gate.close(value) is False, where
                    gate.open()
                counts["timed out"] += 1
        counts["timeouts"] += 1
    for _ in range(100):  # short finite ones: a bell not rung times out, an idle gate answers at once
        value = rng.choice((0.0, -0.0, 5e-324, rng.uniform(0, 0.002)))
        assert bell.wait(value) is False and gate.wait_idle(value) is True
        counts["timed out"] += 1
    report(capsys, name, counts)
