"""Sampled tokens straight back to the head: the final stage's side and the head's side.

Relayed, a batch's outputs travel back up through every stage, one gRPC leg per stage. A
final stage configured with ``return_to`` also sends them straight to the head over one
long-lived ReturnResults stream; the head takes whichever copy arrives first. The relay
stays the backstop, and the only carrier of errors: a direct copy that is lost or late
costs nothing but the time the relay takes, and every failure still travels up through
the stages, each freeing its sessions on the way (see ``Stage.process``).

Keys are random per step, so a stale or forged return cannot settle another step.
"""

from __future__ import annotations

import queue
import threading
import uuid

import grpc
import structlog

from skippy_stage.config import PeerConfig
from skippy_stage.downstream import HopFuture, channel_options
from skippy_stage.security import Credentials
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

log = structlog.get_logger("skippy_stage.returns")


class ReturnBox:
    """The head's table of steps waiting for their outputs, by return key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, HopFuture] = {}

    def expect(self, future: HopFuture) -> str:
        key = uuid.uuid4().hex
        with self._lock:
            self._waiting[key] = future
        return key

    def forget(self, key: str) -> None:
        with self._lock:
            self._waiting.pop(key, None)

    def deliver(self, key: str, response: pb.IterationBatchResponse) -> bool:
        """Settle the step waiting under ``key``; False if none waits (late, or unknown)."""
        with self._lock:
            future = self._waiting.pop(key, None)
        return future is not None and future.settle(result=response)


class ReturnClient:
    """The final stage's stream to the head. Sending never blocks and never raises: a
    broken stream is logged and reopened, and the relayed copy serves meanwhile."""

    def __init__(self, head: PeerConfig, *, stage_id: str, max_message_bytes: int,
                 credentials: Credentials | None = None) -> None:
        self.log = log.bind(stage_id=stage_id, head=head.stage_id, endpoint=head.endpoint)
        creds = credentials or Credentials()
        self._metadata = creds.call_metadata()
        self._channel = creds.channel(head.endpoint, channel_options(max_message_bytes))
        self._stub = pb_grpc.StageServiceStub(self._channel)
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue | None = None
        self._call: grpc.Future | None = None
        self._closed = False

    def _open(self) -> queue.SimpleQueue:
        with self._lock:
            if self._outbox is None or self._call is None or self._call.done():
                if self._call is not None and self._call.done():
                    self.log.warning("return stream to the head ended; reopening",
                                     error=_describe(self._call))
                if self._outbox is not None:
                    self._outbox.put(None)  # ends the old stream's request iterator (and its thread)
                outbox: queue.SimpleQueue = queue.SimpleQueue()

                def items(box: queue.SimpleQueue = outbox):  # noqa: ANN202
                    while (item := box.get()) is not None:
                        yield item
                self._call = self._stub.ReturnResults.future(items(), metadata=self._metadata)
                self._outbox = outbox
            return self._outbox

    def send(self, key: str, response: pb.IterationBatchResponse) -> None:
        if self._closed:
            return
        self._open().put(pb.ReturnedBatch(return_key=key, response=response))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._outbox is not None:
                self._outbox.put(None)
            if self._call is not None:
                self._call.cancel()
        self._channel.close()


def _describe(call: grpc.Future) -> str:
    try:
        error = call.exception(timeout=0)
    except Exception as exc:  # noqa: BLE001 - cancelled calls raise here
        return repr(exc)
    if error is None:
        return "closed by the head"
    return f"{error.code().name}: {error.details()}" if isinstance(error, grpc.RpcError) else repr(error)
