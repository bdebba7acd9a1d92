"""The compiled frame path's test bench (``stage/native_frames.py``, ``stage/native/*.c``), shared by
``tests/stage/test_native_frames.py`` and ``tests/stage/test_frame_fuzz.py``: the real SmolLM2 splits
in one process (``chain``: 0:15 / 15:30; ``chain3``: 0:10 / 10:20 / 20:30), the C paths on their stages,
a socket pair standing for the next link (``ReturnLink``), the frames the stages above would send
(``body``, ``head_step``), and the stages below the head answering its lone generation (``Below``).

The fixtures reach the tests through ``tests/stage/conftest.py``; a test module that needs another
shape of chain overrides ``chain3`` (or ``chain``), and the fixtures built on it follow.
"""

from __future__ import annotations

import socket
import threading
import time
import types
from collections.abc import Iterator

import numpy as np
import pytest

from skippy_stage.model.runtime import BatchEntry, StageRuntime
from skippy_stage.model.sampling import SamplingParams
from skippy_stage.stage import framing, native_frames
from skippy_stage.stage.codec import sampling_to_pb
from skippy_stage.stage.gate import EdgeGate
from skippy_stage.stage.upstream import Routes
from skippy_stage.v1 import stage_pb2 as pb
from support.chain import Chain, split_configs

PROMPT = "The capital of France is"
N_EMBD = 576
STAGE_ID = "stage-final"
SINK = "sink"  # a link's back channel, as the C path is given it: the owner of the sessions it opened


def load_chain(model, slice_cache, ranges: list[tuple[int, int]], **overrides: object) -> Iterator[Chain]:
    """The split of ``model`` at ``ranges`` in one process, closed after (a fixture's body: ``yield from``).
    Separate lanes (kv_unified off): two sessions fed the same rows then compute the same bits."""
    settings: dict[str, object] = dict(n_batch=64, n_ubatch=64, ctx_size=1024, lane_count=4, kv_unified=False,
                                       n_threads=1)
    settings.update(overrides)
    built = Chain(split_configs(model, ranges, slice_cache, **settings))
    try:
        yield built
    finally:
        built.close()


@pytest.fixture(scope="module")
def chain(smollm2, slice_cache):
    yield from load_chain(smollm2, slice_cache, [(0, 15), (15, 30)])


class ReturnLink:
    """The head's end of the return link: a socket pair, read back as ReturnedBatch messages."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.head = framing.FrameSocket(self.theirs, max_message_bytes=1 << 20)
        self.lock = threading.Lock()

    def read(self) -> pb.ReturnedBatch:
        kind, body = self.head.receive()
        return framing.parse(kind, body, framing.Kind.RETURNED_BATCH)

    def pending(self) -> bool:
        self.theirs.setblocking(False)
        try:
            return bool(self.theirs.recv(1 << 16, socket.MSG_PEEK))
        except BlockingIOError:
            return False
        finally:
            self.theirs.setblocking(True)

    def close(self) -> None:
        self.ours.close()
        self.theirs.close()


@pytest.fixture
def link():
    made = ReturnLink()
    yield made
    made.close()


@pytest.fixture(scope="module")
def native(chain):
    tail = chain.stages[1]
    return native_frames.frame_path(tail.native_frame_args(), hop_timeout_s=30.0, routes=None,
                                    stage_id=STAGE_ID.encode())


def body(session: str, position: int, token: int | None, rows: np.ndarray, *, return_key: str = "k",
         sampling: pb.SamplingParams | None = None, relay: bool = False, layer_end: int = 15, timeout_s: float = 0.0,
         **entry_fields) -> bytes:
    payload = np.ascontiguousarray(rows, dtype=np.float32).tobytes()
    descriptor = pb.FrameDescriptor(version=1, dtype=pb.DTYPE_F32, layout=pb.LAYOUT_TOKEN_MAJOR, producer_stage_index=0,
                                    layer_start=0, layer_end=layer_end, token_count=rows.shape[0],
                                    sequence_count=rows.shape[0], payload_bytes=len(payload), width=rows.shape[1])
    entry = pb.BatchEntry(session_id=session, phase=pb.PHASE_DECODE, positions=[position],
                          token_ids=[] if token is None else [token], sample_last=True,
                          sampling=sampling_to_pb(None) if sampling is None else sampling, **entry_fields)
    request = pb.IterationBatchRequest(request_id="r", entries=[entry], return_key=return_key,
                                       frame=pb.ActivationFrame(descriptor=descriptor, payload=payload))
    return pb.HopRequest(hop_id=3, request=request, relay=relay, sent_unix_ns=time.time_ns(),
                         timeout_s=timeout_s).SerializeToString()


def head_rows(head: StageRuntime, session: str, positions, tokens) -> np.ndarray:
    return head.run_batch([BatchEntry(session, np.asarray(positions), token_ids=np.asarray(tokens))])[0].hidden


def prefill(chain, session: str, owner: object = None) -> tuple[int, int]:
    """``session`` bound at the final stage (and "h-<session>" at the head) with the prompt: its
    next position and the token the final stage sampled. ``owner``: the link it is opened over
    (the C path takes a session's frames from that link only)."""
    head, tail = chain.stages
    tokens = tail.tokenizer.tokenize(PROMPT)
    rows = head_rows(head, "h-" + session, range(len(tokens)), tokens)
    token = tail.run_batch([BatchEntry(session, np.arange(len(tokens)), token_ids=np.asarray(tokens), hidden=rows,
                                       sample=True, sampling=SamplingParams())], owner)[0].token
    return len(tokens), token


def state(tail: StageRuntime, session: str) -> tuple[int, int, list[int]]:
    lane = tail.lanes.lane_of(session)
    return lane.n_tokens, lane.batches, list(tail._history[session])


@pytest.fixture(scope="module")
def chain3(smollm2, slice_cache):
    yield from load_chain(smollm2, slice_cache, [(0, 10), (10, 20), (20, 30)])


@pytest.fixture
def inner(chain3):
    """The middle stage's native path, and the routes it claims return keys in."""
    routes = Routes()
    path = native_frames.frame_path(chain3.stages[1].native_frame_args(), hop_timeout_s=2.5, routes=routes,
                                    stage_id=b"stage-mid")
    return path, routes


def read_forwarded(link: ReturnLink, sent: bytes, expected: np.ndarray, *, producer: int,
                   layers: tuple[int, int]) -> pb.HopRequest:
    """The next frame the C path sent on ``link`` for the frame ``sent``: its one row is the Python
    path's (``expected``) bit for bit, its entries the ones that came in, byte for byte, and its
    descriptor names this stage and its layers."""
    kind, raw = link.head.receive()
    forwarded = framing.parse(kind, raw, framing.Kind.HOP_REQUEST)
    request = forwarded.request
    got = np.frombuffer(request.frame.payload, dtype=np.float32).reshape(1, N_EMBD)
    assert np.array_equal(got, expected)
    assert [e.SerializeToString() for e in request.entries] == [
        e.SerializeToString() for e in pb.HopRequest.FromString(sent).request.entries]
    d = request.frame.descriptor
    assert (d.dtype, d.producer_stage_index, d.layer_start, d.layer_end, d.width, d.token_count,
            d.sequence_count, d.payload_bytes) == (pb.DTYPE_F32, producer, *layers, N_EMBD, 1, 1, 4 * N_EMBD)
    return forwarded


@pytest.fixture
def head_path(chain3):
    return native_frames.frame_path(chain3.stages[0].native_frame_args(), hop_timeout_s=2.5, routes=None,
                                    stage_id=b"stage-head")


def head_step(session: str, position: int, token: int, *, return_key: str = "k", timeout_s: float = 0.0,
              with_frame: bool = False, **entry_fields) -> bytes:
    """The head's step as it encodes it for the C path: the frame it sends, minus the rows."""
    entry = dict(session_id=session, phase=pb.PHASE_DECODE, positions=[position], token_ids=[token],
                 sample_last=True, sampling=sampling_to_pb(None), draws_before=position)
    entry.update(entry_fields)
    request = pb.IterationBatchRequest(request_id="step-1", entries=[pb.BatchEntry(**entry)], return_key=return_key)
    if with_frame:
        request.frame.payload = b"\0" * 4 * N_EMBD
    return pb.HopRequest(request=request, timeout_s=timeout_s).SerializeToString()


class Edge:
    """What the lone loop checks each step is still the head's edge: ``stage.downstream`` and its
    hop's ``plain_link`` (identity only)."""

    def __init__(self, link: ReturnLink) -> None:
        self.link = link
        self.downstream = types.SimpleNamespace(hop=types.SimpleNamespace(plain_link=link))
        self.stage = types.SimpleNamespace(downstream=self.downstream)


def returned(key: str, session: str, token: int, *, extra: dict | None = None) -> bytes:
    out = pb.EntryOutput(session_id=session, has_token=True, token=token, **(extra or {}))
    return pb.ReturnedBatch(return_key=key, response=pb.IterationBatchResponse(
        outputs=[out], final_stage_id="stage-final")).SerializeToString()


class Below:
    """The stages below the head on the other end of the link: reads each frame the loop sends
    and answers it through the head's ReturnWait — ``answer(request)`` returns the return's
    bytes (handed over with ``take``), an exception or Outputs (``settle``), or None (silence)."""

    def __init__(self, link: ReturnLink, wait, answer) -> None:
        self.link, self.wait, self.answer = link, wait, answer
        self.frames: list[pb.HopRequest] = []
        self.taken: list[bool] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                kind, raw = self.link.head.receive()
            except (framing.LinkClosed, OSError):
                return
            frame = framing.parse(kind, raw, framing.Kind.HOP_REQUEST)
            self.frames.append(frame)
            reply = self.answer(frame.request)
            if isinstance(reply, bytes):
                self.taken.append(self.wait.take(reply))
            elif reply is not None:
                self.taken.append(self.wait.settle(frame.request.return_key, reply))


def lone(head_path, edge: Edge, wait, entry: bytes, position: int, token: int, *, limit: int = 100,
         eog: tuple[int, ...] = (), timeout_s: float = 5.0, on_token=lambda token: True, bell=None,
         key_prefix: bytes = b"run"):
    """``head_path.lone`` for the session of ``entry`` (``lone_entry``) at ``position`` fed ``token``, each
    step's frame sent on ``edge``'s link as request "step-7" (then "step-7+<n>") under the return key
    "<key_prefix>.<n>"; ``on_token(fed)`` says whether to go on."""
    return head_path.lone(wait=wait, template=entry, request_id=b"step-7", key_prefix=key_prefix, position=position,
                          token=token, draws=position, limit=limit, eog=np.asarray(eog, dtype=np.int32).tobytes(),
                          timeout_s=timeout_s, sock=edge.link.ours, send_lock=edge.link.lock,
                          gate_pass=EdgeGate().passing(), stage=edge.stage, downstream=edge.downstream,
                          link=edge.link, on_token=lambda fed, from_c: on_token(fed), bell=bell)


def lone_entry(session: str) -> bytes:
    return pb.BatchEntry(session_id=session, phase=pb.PHASE_DECODE, sample_last=True,
                         sampling=sampling_to_pb(None)).SerializeToString()


@pytest.fixture
def lone_head(chain3):
    """The head with the prompt in sessions "py" (the Python path's) and "lone"; its next position."""
    head = chain3.stages[0]
    tokens = head.tokenizer.tokenize(PROMPT)
    for session in ("py", "lone"):
        head_rows(head, session, range(len(tokens)), tokens)
    yield head, len(tokens)
    for session in ("py", "lone"):
        head.drop_session(session)
