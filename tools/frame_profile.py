#!/usr/bin/env python3
"""Where a stage's time per token goes, apart from its layers: the Python on the frame path.

    python tools/frame_profile.py [--frames 300] [--cold]

Loads the packaged SmolLM2 split 0:10/10:20/20:30 in this process and runs each stage's own
per-token path on a real one-token decode frame, again and again (the same position, rewound):

* the head: ``Stage.process`` of a decode step, the stage below answering at once (the frame
  encoded as the TCP hop would, the outputs parsed as the head's return listener would);
* the inner and the final stage: a frame's bytes parsed as the TCP listener does, then
  ``Stage.accept_frame`` (checks, llama_decode, the capture or the sample, the next frame or
  the return encoded for the socket).

For each it prints the median time per frame, of it llama_decode's, and the rest: the Python
(and protobuf) a token pays at that stage. ``--cold`` evicts the caches between frames as the
other stages' compute does in a pipeline on shared cores. Only ratios within one run mean
anything on a noisy host; sockets, wakes and the other processes are not in these figures
(``skippy-stage bench`` has them).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import numpy as np

import skippy_stage.model.runtime as runtime_module
from skippy_stage.model.chain import chain_configs
from skippy_stage.model.packaged import smollm2_path
from skippy_stage.model.sampling import SamplingParams
from skippy_stage.stage import codec, framing
from skippy_stage.stage.stage import Stage
from skippy_stage.stage.steps import PHASE_DECODE, PHASE_PREFILL, Activations, Output, Outputs, Step, StepEntry

PROMPT = [1, 504, 3575, 282, 4649, 314]
GREEDY = SamplingParams(temperature=0.0)


class _Below:
    """The stage below, answering every frame at once: keeps the last frame; the head's outputs
    travel as bytes and are parsed as the head's return listener parses them."""

    runtime = object()

    def __init__(self, above: Stage, answer: bool) -> None:
        self.above, self.answer, self.inbound, self.frame = above, answer, above.inbound, None

    def accept_frame(self, frame, sink) -> None:
        self.frame = frame
        framing.encode(framing.Kind.HOP_REQUEST, codec.frame_to_pb(frame))
        if self.answer:
            out = Outputs([Output(e.session_id, 42) for e in frame.step.entries], "below")
            body = codec.returned_to_pb(frame.step.return_key, out).SerializeToString()
            batch = framing.parse(framing.Kind.RETURNED_BATCH, body, framing.Kind.RETURNED_BATCH)
            self.above.deliver_return(batch.return_key, codec.outputs_from_pb(batch.response))


def _timed_decode(log: list[int]):
    real = runtime_module.llama_cpp.llama_decode

    def decode(ctx, batch):
        started = time.perf_counter_ns()
        try:
            return real(ctx, batch)
        finally:
            log.append(time.perf_counter_ns() - started)
    return real, decode


def _frame_for(stages: list[Stage], index: int) -> framing.pb.HopRequest:
    """A one-token decode frame for stage ``index``: the prompt's frame, cut to its first row."""
    catch = _Below(stages[index - 1], answer=False)
    stages[index - 1].connect_local(catch)
    for upper, lower in zip(stages[: index - 1], stages[1:index]):
        upper.connect_local(lower)
    prefill = StepEntry(session_id="s", phase=PHASE_PREFILL, positions=range(len(PROMPT)), token_ids=PROMPT,
                        sample_last=True, sampling=GREEDY)
    try:
        stages[0].process(Step(request_id="p", entries=[prefill]), 0.2)
    except Exception:  # noqa: BLE001 - nothing answers from below; the frame is what counts
        pass
    prompt_frame = catch.frame
    if not stages[index].config.include_output:
        stages[index].connect_local(_Below(stages[index], answer=False))
    stages[index].accept_frame(prompt_frame, lambda reply: None)
    act = prompt_frame.step.frame
    row = len(act.payload) // len(PROMPT)
    one = Step(request_id="d", entries=[StepEntry(session_id="s", phase=PHASE_DECODE, positions=[len(PROMPT)],
                                                  sample_last=True, sampling=GREEDY, rewind=True)],
               frame=Activations(dataclasses.replace(act.descriptor, token_count=1, payload_bytes=row),
                                 act.payload[:row]), return_key=prompt_frame.step.return_key)
    return codec.frame_to_pb(dataclasses.replace(prompt_frame, step=one))


def _measure(run, frames: int, cold: bool) -> tuple[float, float]:
    decodes: list[int] = []
    real, decode = _timed_decode(decodes)
    runtime_module.llama_cpp.llama_decode = decode
    evict = np.ones(32 * 1024 * 1024 // 8) if cold else None
    totals = []
    try:
        for _ in range(frames + 20):
            if evict is not None:
                evict += 1.0
            started = time.perf_counter_ns()
            run()
            totals.append(time.perf_counter_ns() - started)
    finally:
        runtime_module.llama_cpp.llama_decode = real
    totals, decodes = totals[20:], decodes[-frames:]
    return statistics.median(totals) / 1e3, statistics.median(decodes) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--cold", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="skippy-profile-") as tmp:
        configs = chain_configs(smollm2_path(), [(0, 10), (10, 20), (20, 30)], tmp, n_threads=2, kv_unified=False)
        rows = []
        for index, name in ((0, "head (0:10)"), (1, "inner (10:20)"), (2, "final (20:30)")):
            stages = [Stage(c, max_message_bytes=c.max_message_bytes) for c in configs[: index + 1]]
            for stage in stages:
                stage.load()
            try:
                if index == 0:
                    head = stages[0]
                    head.connect_local(_Below(head, answer=True))
                    head.process(Step(request_id="p", entries=[StepEntry(
                        session_id="s", phase=PHASE_PREFILL, positions=range(len(PROMPT)), token_ids=PROMPT,
                        sample_last=True, sampling=GREEDY)]), 5.0)

                    def run(head=head) -> None:
                        head.process(Step(request_id="d", entries=[StepEntry(
                            session_id="s", phase=PHASE_DECODE, positions=range(6, 7), token_ids=[42],
                            sample_last=True, sampling=GREEDY, rewind=True)]), 5.0)
                else:
                    body = _frame_for(stages, index).SerializeToString()
                    stage = stages[index]

                    def run(stage=stage, body=body) -> None:
                        msg = framing.parse(framing.Kind.HOP_REQUEST, body, framing.Kind.HOP_REQUEST)
                        stage.accept_frame(codec.frame_from_pb(msg), lambda reply: None)
                total, decode = _measure(run, args.frames, args.cold)
                rows.append((name, total, decode))
            finally:
                for stage in stages:
                    stage.close()
    print(f"{'stage':16} {'per frame us':>13} {'llama_decode':>13} {'the rest':>10} {'rest/decode':>12}")
    for name, total, decode in rows:
        print(f"{name:16} {total:13.0f} {decode:13.0f} {total - decode:10.0f} {(total - decode) / decode:12.2f}")


if __name__ == "__main__":
    main()
