"""A stage's frame path in C (``native/``: the files are mapped in ``frames.h``), for the frames it
can prove plain; and the head's own plain decode steps through the same code (``NativeHead``).

A plain decode frame — one position per entry of a session already bound here, f32 hidden rows,
no rewind, prefix or fork — costs a stage's Python frame path ~300 us on co-located stages (its
bytecode runs on caches the decode just evicted). The C path parses the bytes, checks them,
admits the entries through the runtime's own lane table and locks, decodes, and sends the
result on, in one call: at the final stage each token picked as llama.cpp's greedy sampler
picks it (plain greedy settings only) and the ReturnedBatch straight to the head; at an inner
stage the captured rows as the next HopRequest, the entries forwarded as they came, its return
key routed through ``Stage.routes`` as the Python path routes it.

Anything else it declines before touching any state, and the frame runs the Python path as it
always did — so every refusal keeps the message that path gives, naming the field. What the C
path does not do itself happens here, after the frame has left: the metrics, and the rare
outcomes (a decode that failed: the sessions are freed and the error goes up the edge; a link
that broke in the send: the final stage relays the outputs up the edge instead, an inner stage
reports the broken edge as the Python path does).

The head's lone greedy generation (``NativeHead.lone``) runs the same code step after step: one
session alone, each token that comes back fed to the next step without the scheduler between
them. Its tokens come over the return link, which the head's listener reads in C
(``return_reader``) so a token is handed over without the GIL.

The C side takes the runtime's raw pointers (its context, llama.cpp's functions, the batch
buffers) as capsules named for their argument (``capsule``, ``frame_path``): anything else there
is a TypeError, never a dereference. Of the Python objects it is given it reads public names only:
``StageRuntime.closed``, the lane table's ``SessionLane`` fields, ``SamplerChain.argmax``,
``Stage.downstream``, ``DownstreamClient.hop``, ``TcpHop.plain_link``, ``Routes.claim``.
"""

from __future__ import annotations

import ctypes
import secrets
import threading

from skippy_stage import tracing
from skippy_stage.errors import InvalidRequestError
from skippy_stage.metrics import Tally
from skippy_stage.model.runtime import decode_error
from skippy_stage.model.sampling import plain_greedy
from skippy_stage.stage import codec, framing
from skippy_stage.stage.downstream import DownstreamClient
from skippy_stage.stage.hops import TcpHop
from skippy_stage.stage.returns import TcpReturn
from skippy_stage.stage.steps import Frame, Reply, Step, check_sampling
from skippy_stage.v1 import stage_pb2 as pb

try:
    from skippy_stage.stage import _frames
except ImportError as exc:  # built by ``pip install`` where a C compiler is; else Python runs every frame
    _frames = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = ""

_UNSENT, _DECODE_FAILED = 1, 2  # run()'s status; 0: sent
# lone()'s outcomes (frames.h's LONE_*)
LONE_TOKEN, LONE_SETTLED, LONE_DECLINED, LONE_DECODE_FAILED, LONE_UNSENT, LONE_TIMEOUT = range(6)
_MARKS = ("parsed", "d0", "d1", "s1")  # tracing's names for the C path's clock readings
_INVALID, _VALID, _PLAIN_GREEDY = 0, 1, 2

# FramePath's arguments that are C pointers; each goes in as a capsule named
# "skippy_stage._frames.<argument>" (frames.h's SK_CAPSULE_PREFIX), the name C checks. The names'
# bytes live as long as the module: a capsule keeps a pointer to its name.
POINTER_ARGS = ("ctx", "mem", "decode", "logits_ith", "seq_rm", "batch", "pos", "seq", "out", "embd", "capture",
                "token")
_CAPSULE_NAMES = {name: f"skippy_stage._frames.{name}".encode() for name in POINTER_ARGS}
# PyCapsule_New through a prototype of its own (setting restype on ``ctypes.pythonapi.PyCapsule_New``
# would change it for everyone in the process); called with the GIL held.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


def capsule(argument: str, address: int | None) -> object | None:
    """The C pointer ``address`` as FramePath takes it for ``argument`` (one of ``POINTER_ARGS``): a
    capsule named for that argument; None for no pointer (0 or None, where the argument is optional).
    The capsule owns nothing: what it points into stays the runtime's."""
    if not address:
        return None
    return _capsule_new(address, _CAPSULE_NAMES[argument], None)


def frame_path(runtime_args: dict[str, object], *, hop_timeout_s: float, routes, stage_id: bytes):
    """A ``_frames.FramePath`` on ``runtime_args`` (``StageRuntime.native_frame_args()``: addresses
    for its pointers, which go in as capsules); ``routes`` an inner stage's ``Stage.routes``, else None."""
    args = {k: capsule(k, v) if k in _CAPSULE_NAMES else v for k, v in runtime_args.items()}
    return _frames.FramePath(**args, hop_timeout_s=hop_timeout_s, routes=routes, classify=classify,
                             stage_id=stage_id)


def classify(raw: bytes) -> int:
    """A SamplingParams message (its bytes) as the C path needs it: invalid (the Python path
    refuses it), valid, or plain greedy. Asked once per distinct message, then remembered."""
    try:
        params = check_sampling(codec.sampling_from_pb(pb.SamplingParams.FromString(raw)), "sampling")
    except Exception:  # noqa: BLE001 - undecodable or invalid: the Python path says why
        return _INVALID
    return _PLAIN_GREEDY if plain_greedy(params) else _VALID


def available() -> str:
    """Empty when the native path is built, else why not."""
    return "" if _frames is not None else f"native frame path not built: {_IMPORT_ERROR}"


def _run(path, body: bytes, link, sink) -> tuple | None:
    """``path.run`` on ``link``'s socket under its send lock; its clock readings become tracing's marks."""
    done = path.run(body, link.sock, link.send_lock, sink)
    if done is not None:
        for name, t_ns in zip(_MARKS, done[7]):
            tracing.mark_at(name, t_ns)
    return done


class NativeFrames:
    """One stage's native frame path; ``run`` a frame's bytes, False when declined."""

    def __init__(self, stage, args: dict[str, object]) -> None:  # stage: a Stage (it imports this module)
        self.stage = stage
        self.final = stage.config.include_output
        self._path = frame_path(args, hop_timeout_s=stage.timeouts.hop_s,
                                routes=None if self.final else stage.routes, stage_id=stage.config.stage_id.encode())
        # Frames ``serve`` sent on as plain successes, their ``end`` left to ``drain`` (a scrape).
        self._kept: list[tuple] = []
        self._draining = threading.Lock()
        stage.metrics.before_scrape(self.drain)

    def _target(self):
        """Where this stage's output goes (a TcpReturn or a TcpHop) and its plain link, or None."""
        stage = self.stage
        if self.final:
            target = stage.return_path
            if not isinstance(target, TcpReturn):
                return None
        else:
            downstream = stage.downstream
            target = downstream.hop if isinstance(downstream, DownstreamClient) else None
            if not isinstance(target, TcpHop):
                return None
        link = target.plain_link
        return None if link is None else (target, link)

    def run(self, body: bytes, sink) -> bool:
        """Run the HopRequest ``body`` from the edge whose back channel is ``sink``; False (nothing
        done) when the Python path must take it."""
        held = self.begin()
        if held is None:
            return False
        done = None
        try:
            done = self._path.run(body, held[0], held[1], sink)
        finally:
            self.end(held, done, body, sink)
        return done is not None

    def serve(self, reader: LinkReader, sink) -> tuple[int, bytes]:
        """Read ``reader``'s link and run its plain frames in C (``FramePath.serve``) until a message
        the Python path must take: returned as ``LinkReader.receive`` returns it."""
        try:
            got = self._path.serve(reader._reader, self.begin, self.end, sink, self._kept)
        except OSError as exc:
            raise framing.LinkClosed(f"receive failed: {exc}") from exc
        return _message(got)

    def begin(self) -> tuple | None:
        """A plain frame's way through this stage: the gate passed, then (socket, send lock,
        target, link) of where its output goes and the gate's pass (``serve`` leaves it itself
        for a plain success); None, holding nothing, when the Python path must take the frame
        (the stage is not taking frames, or its output has no plain link)."""
        stage = self.stage
        if not stage.accepting_frames:
            return None
        passing = stage.gate.passing()
        passing.__enter__()
        # Read inside the gate: a hand-off switches the downstream while the gate is closed.
        found = self._target()
        if found is None:
            passing.__exit__(None, None, None)
            return None
        target, link = found
        return link.sock, link.send_lock, target, link, passing

    def end(self, held: tuple, done: tuple | None, body: bytes | None, sink) -> None:
        """After ``begin``: the frame's outcome (``FramePath.run``'s result; None: nothing done) seen
        to, the gate left, then its metrics. ``body``: the frame, where the outcome is not plain
        success."""
        stage = self.stage
        tally = Tally()
        try:
            if done is not None:
                self._outcome(held, done, body, sink, tally)
        finally:
            stage.gate.passing().__exit__(None, None, None)
        if done is not None:
            stage.metrics.record(tally)
        if self._kept:  # ``serve`` ends frames here once it has kept its most: keep them flowing
            self.drain()

    def drain(self) -> None:
        """Record the frames ``serve`` kept (plain successes: their gate pass already left)."""
        with self._draining:
            kept = self._kept[:]
            if not kept:
                return
            del self._kept[: len(kept)]  # what ``serve`` added meanwhile stays, for the next drain
        tally = Tally()
        for done in kept:
            self._outcome(None, done, None, None, tally)
        self.stage.metrics.record(tally)

    def _outcome(self, held: tuple | None, done: tuple, body: bytes | None, sink, tally: Tally) -> None:
        """``held`` (begin's) and ``sink`` are read only for an outcome that is not plain success."""
        stage = self.stage
        status, rc, compute_s, latency_s, entries, payload_bytes, message, marks, key = done
        for name, t_ns in zip(_MARKS, marks):
            tracing.mark_at(name, t_ns)
        if latency_s >= 0:
            tally.latencies.append(latency_s)
        tally.received.append(("f32", payload_bytes))
        tally.computes.append((compute_s, entries, entries, []))
        tally.native += 1
        if status == _DECODE_FAILED:
            stage.refuse_frame(self._frame(body), decode_error(rc, entries), sink)
        elif status == _UNSENT and self.final:
            target, link = held[2], held[3]
            target.broke(link, "send failed")
            returned = pb.ReturnedBatch.FromString(message)
            sink(Reply(hop_id=self._frame(body).hop_id, return_key=returned.return_key,
                       outputs=codec.outputs_from_pb(returned.response)))
            tally.returns.append("relayed")
            tally.frames_ok += 1
        elif status == _UNSENT:
            target, link = held[2], held[3]
            stage.routes.take(key)
            stage.refuse_frame(self._frame(body), target.broke(link, "send failed"), sink)
        else:
            if self.final:
                tally.returns.append("sent")
            else:
                tally.sent.append(("f32", payload_bytes))
            tally.frames_ok += 1

    @staticmethod
    def _frame(body: bytes):
        """The frame as the Python path reads it (for the rare outcomes; the C path parsed it)."""
        return codec.frame_from_pb(framing.parse(framing.Kind.HOP_REQUEST, body, framing.Kind.HOP_REQUEST))


class NativeHead:
    """The head's own plain decode steps in C: the step goes in encoded as the frame it becomes
    (minus the rows), the head's layers run on its token ids, and the frame with the rows leaves
    on the downstream link, in one call; the head's Python around a token's decode shrinks to the
    scheduler's bookkeeping. Declined steps (prompts, speculation, anything the C path does not
    prove plain) and the first frame (it opens the link) run the Python path."""

    def __init__(self, stage, args: dict[str, object]) -> None:
        self._path = frame_path(args, hop_timeout_s=stage.timeouts.hop_s, routes=None,
                                stage_id=stage.config.stage_id.encode())
        self.row_bytes = 4 * int(args["n_embd"])
        # Where a lone generation waits for its step's return (``ReturnBox`` settles it, the
        # return listener hands it plain tokens).
        self.wait = _frames.ReturnWait(n_vocab=int(args["n_vocab"]))
        self._lone_lock = threading.Lock()  # one lone run at a time (two scheduler workers may try)

    def run(self, step: Step, downstream, *, relay: bool, timeout_s: float, tally: Tally) -> bool:
        """Decode ``step`` here and send its frame down ``downstream`` (the edge the caller read
        once); False (nothing done) when the Python path must. Raises as that path would: the
        decode's error, or the broken link's."""
        if not all(len(e.positions) == 1 and not e.rewind and e.prefix_id is None and e.fork_of is None
                   and e.embd is None for e in step.entries):
            return False  # prompts and speculation: never plain, not worth encoding to find out
        hop = downstream.hop if isinstance(downstream, DownstreamClient) else None
        link = hop.plain_link if isinstance(hop, TcpHop) else None
        if link is None:
            return False
        body = codec.frame_to_pb(Frame(step=step, relay=relay, timeout_s=timeout_s)).SerializeToString()
        done = _run(self._path, body, link, None)
        if done is None:
            return False
        status, rc, compute_s, _, entries, _, _, _, _ = done
        tally.computes.append((compute_s, entries, entries, []))
        tally.native += 1
        if status == _DECODE_FAILED:
            raise decode_error(rc, entries)
        if status == _UNSENT:
            raise hop.broke(link, "send failed")
        tally.sent.append(("f32", entries * self.row_bytes))
        return True

    def lone(self, step: Step, stage, downstream, link, *, timeout_s: float, limit: int, eog: bytes,
             on_token, bell=None) -> tuple | None:
        """Run ``step`` (one plain decode entry) and the steps that follow it on each token that
        comes back, in C (``FramePath.lone``: the outcomes and the limits are its); None (nothing
        done) when the step is not one it can take. Before each step the loop checks that
        ``stage.downstream`` is still ``downstream`` and its ``hop.plain_link`` still ``link`` (a
        hand-off switches them), and declines the step otherwise."""
        entry = step.entries[0] if len(step.entries) == 1 else None
        if (entry is None or len(entry.positions) != 1 or entry.token_ids is None or len(entry.token_ids) != 1
                or entry.rewind or entry.prefix_id is not None or entry.fork_of is not None
                or not step.request_id.isascii() or len(step.request_id) > 200):
            return None
        request = codec.frame_to_pb(Frame(step=step, relay=False, timeout_s=timeout_s)).request
        wire = request.entries[0]
        position, token, draws = wire.positions[0], wire.token_ids[0], wire.draws_before
        for name in ("positions", "token_ids", "draws_before"):
            wire.ClearField(name)
        if not self._lone_lock.acquire(blocking=False):
            return None
        try:
            return self._path.lone(
                wait=self.wait, template=wire.SerializeToString(), request_id=step.request_id.encode(),
                key_prefix=secrets.token_hex(16).encode(), position=position, token=token, draws=draws, limit=limit,
                eog=eog, timeout_s=timeout_s, sock=link.sock, send_lock=link.send_lock, gate_pass=stage.gate.passing(),
                stage=stage, downstream=downstream, link=link, on_token=on_token,
                bell=bell if isinstance(bell, _frames.Bell) else None)
        finally:
            self._lone_lock.release()


def return_reader(link: framing.FrameSocket):
    """A C reader of the head's return ``link`` (a _frames.FrameReader) where it is plain and
    the native path is built; else None (the link reads itself). The reader takes over what the
    link had buffered; from then on only it reads the link."""
    if _frames is None or framing.plain(link) is None:
        return None
    reader = _frames.FrameReader(link.sock.fileno(), link.max_message_bytes, bytes(link._inbox))
    link._inbox.clear()
    return reader


class LinkReader:
    """A plain link's reading end in C (a _frames.FrameReader), with ``FrameSocket``'s reading
    contract: ``receive`` and ``readable``. A stage below the head reads its upstream's frames
    through it: a frame's bytes reach the frame path without the Python of a buffered read, on
    the path from the upstream's send to this stage's compute (the hop latency)."""

    __slots__ = ("_reader",)

    def __init__(self, reader) -> None:
        self._reader = reader

    def receive(self) -> tuple[int, bytes]:
        try:
            return read(self._reader, None)
        except OSError as exc:
            raise framing.LinkClosed(f"receive failed: {exc}") from exc

    def readable(self) -> bool:
        return self._reader.readable()


def link_reader(link: framing.FrameSocket) -> LinkReader | None:
    """``link``'s reading end in C where it is plain and the native path is built; else None
    (the link reads itself). From then on only the reader reads the link."""
    reader = return_reader(link)
    return None if reader is None else LinkReader(reader)


def read(reader, wait) -> tuple[int, bytes]:
    """The next message on a return link that ``wait`` (the lone generation's ReturnWait, or None)
    did not take; raises as ``FrameSocket.receive`` does."""
    return _message(reader.next(wait))


def _message(got) -> tuple[int, bytes]:
    """A C reader's answer as ``FrameSocket.receive`` gives it (or raises)."""
    if got is None:
        raise framing.LinkClosed("closed by the peer")
    kind, body = got
    if kind < 0:
        raise InvalidRequestError(body)
    return kind, body


def _native_args(stage) -> dict[str, object] | None:
    cfg = stage.config
    if not cfg.native_frames or cfg.hop_transport != "tcp":
        return None
    if not cfg.include_output and cfg.wire_dtype != "f32":
        return None  # the native path writes f32 rows only
    if _frames is None:
        stage.log.warning("frames run in Python", reason=available())
        return None
    return stage.runtime.native_frame_args()


def for_stage(stage) -> NativeFrames | None:
    """The native path for frames from above at ``stage`` (a loaded Stage below the head), or None
    where it cannot or may not run."""
    if stage.config.include_embeddings:
        return None
    args = _native_args(stage)
    return None if args is None else NativeFrames(stage, args)


def for_head(stage) -> NativeHead | None:
    """The native path for the head's own steps (a loaded Stage with layer 0 and a downstream), or
    None where it cannot or may not run."""
    cfg = stage.config
    if not cfg.include_embeddings or cfg.include_output:
        return None
    args = _native_args(stage)
    return None if args is None else NativeHead(stage, args)
