"""The final stage's frame path in C (``native/finalframe.c``), for the frames it can prove plain.

A final stage's plain decode frame — one position per entry of a session already bound here,
f32 hidden rows, plain greedy sampling, no logits, outputs straight to the head over a plain TCP
link — costs the Python frame path ~300 us on co-located stages (its bytecode runs on caches the
decode just evicted). The C path parses the bytes, checks them, admits the entries through the
runtime's own lane table and locks, decodes, picks each token as llama.cpp's greedy sampler does,
writes the sessions' histories, and sends the ReturnedBatch, in one call.

Anything else it declines before touching any state, and the frame runs the Python path as it
always did — so every refusal keeps the message that path gives, naming the field. What the C
path does not do itself happens here, after the tokens have left: the metrics, and the rare
outcomes (a decode llama.cpp refused: the sessions are freed and the error goes up the edge; a
return link that broke in the send: the outputs are relayed up the edge instead).
"""

from __future__ import annotations

import structlog

from skippy_stage import tracing
from skippy_stage.metrics import Tally
from skippy_stage.model.runtime import decode_error
from skippy_stage.model.sampling import plain_greedy
from skippy_stage.stage import codec, framing
from skippy_stage.stage.returns import TcpReturn
from skippy_stage.stage.steps import Reply, check_sampling
from skippy_stage.v1 import stage_pb2 as pb

log = structlog.get_logger("skippy_stage.native_frames")

try:
    from skippy_stage.stage import _finalframe
except ImportError as exc:  # built by ``pip install``; without a C compiler the Python path runs
    _finalframe = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = ""

_STATUS_SENT, _STATUS_UNSENT, _STATUS_DECODE_FAILED = 0, 1, 2
_MARKS = ("parsed", "d0", "d1", "s1")  # tracing's names for the C path's clock readings


def _classify(raw: bytes) -> bool:
    """Whether a SamplingParams message (its bytes) is plain greedy and valid: the C path asks once
    per distinct message and remembers."""
    try:
        params = check_sampling(codec.sampling_from_pb(pb.SamplingParams.FromString(raw)), "sampling")
    except Exception:  # noqa: BLE001 - undecodable or invalid: the Python path says why
        return False
    return plain_greedy(params)


def available() -> str:
    """Empty when the native path is built, else why not."""
    return "" if _finalframe is not None else f"native frame path not built: {_IMPORT_ERROR}"


class NativeFinal:
    """One final stage's native frame path; ``run`` a frame's bytes, False when declined."""

    def __init__(self, stage, args: dict[str, object]) -> None:  # stage: a Stage (it imports this module)
        self.stage = stage
        self._path = _finalframe.FinalPath(**args, classify=_classify, stage_id=stage.config.stage_id.encode())

    def run(self, body: bytes, sink) -> bool:
        """Run the HopRequest ``body`` from the edge whose back channel is ``sink``; False (nothing
        done) when the Python path must take it."""
        stage = self.stage
        return_path = stage.return_path
        if not isinstance(return_path, TcpReturn):
            return False
        link = return_path.plain_link
        if link is None or not stage.accepting_frames:
            return False
        with stage.gate.passing():
            done = self._path.run(body, link.sock, link.send_lock)
            if done is None:
                return False
            status, rc, compute_s, latency_s, entries, payload_bytes, message, marks = done
            for name, t_ns in zip(_MARKS, marks):
                tracing.mark_at(name, t_ns)
            tally = Tally()
            if latency_s >= 0:
                tally.latencies.append(latency_s)
            tally.received.append(("f32", payload_bytes))
            tally.computes.append((compute_s, entries, entries, []))
            tally.native += 1
            if status == _STATUS_DECODE_FAILED:
                frame = codec.frame_from_pb(framing.parse(framing.Kind.HOP_REQUEST, body, framing.Kind.HOP_REQUEST))
                stage.refuse_frame(frame, decode_error(rc, entries), sink)
            elif status == _STATUS_UNSENT:
                return_path.broke(link, "send failed")
                hop = pb.HopRequest.FromString(body)
                returned = pb.ReturnedBatch.FromString(message)
                sink(Reply(hop_id=hop.hop_id, return_key=returned.return_key,
                           outputs=codec.outputs_from_pb(returned.response)))
                tally.returns.append("relayed")
                tally.frames_ok += 1
            else:
                tally.returns.append("sent")
                tally.frames_ok += 1
        stage.metrics.record(tally)
        return True


def for_stage(stage) -> NativeFinal | None:
    """The native path for ``stage`` (a loaded Stage), or None where it cannot or may not run."""
    cfg = stage.config
    if not cfg.native_frames or not cfg.include_output or cfg.include_embeddings or cfg.hop_transport != "tcp":
        return None
    if _finalframe is None:
        stage.log.warning("frames run in Python", reason=available())
        return None
    args = stage.runtime.native_final_args()
    if args is None:
        return None
    return NativeFinal(stage, args)
