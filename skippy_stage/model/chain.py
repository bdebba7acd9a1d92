"""Stage runtimes chained in one process: a split run without a network.

Each stage's own :class:`StageRuntime` runs, and hidden states go from one to the next
exactly as the data plane hands them on, minus the sockets. ``skippy-stage verify`` and
the equivalence tests use it to compare a split with the unsplit model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from skippy_stage.config import PeerConfig, StageConfig, chain_links
from skippy_stage.model.batch import BatchEntry, EntryResult
from skippy_stage.model.mrope import ImageGrid
from skippy_stage.model.runtime import StageRuntime
from skippy_stage.model.sampling import SamplingParams


def chain_configs(model: str | Path, ranges: Sequence[tuple[int, int]], cache_dir: str | Path | None,
                  **overrides: object) -> list[StageConfig]:
    """StageConfigs for consecutive layer ranges, chained upstream to downstream.

    The endpoints are placeholders: an in-process chain opens no sockets.
    """
    links = chain_links([f"stage-{i}" for i in range(len(ranges))],
                        [f"127.0.0.1:{50100 + i}" for i in range(len(ranges))], direct_return=False)
    configs = []
    for i, (start, end) in enumerate(ranges):
        fields: dict[str, object] = dict(
            model_path=str(model), stage_id=f"stage-{i}", stage_index=i, layer_start=start, layer_end=end,
            ctx_size=2048, lane_count=2, **{k: PeerConfig(**v) for k, v in links[i].items()},
        )
        if cache_dir is not None:
            fields["cache_dir"] = str(cache_dir)
        fields.update(overrides)
        configs.append(StageConfig(**fields))
    return configs


@dataclass
class Step:
    """One entry of a chain step: new tokens for a session at its next position."""

    session_id: str
    start: int
    tokens: Sequence[int]
    want_logits: bool = True
    sample: bool = True
    sampling: SamplingParams | None = None
    fork_of: str | None = None  # a new session starting as a copy of this one's first ``start`` tokens
    draws_before: int = 0  # samples the session took before (a sampler built now skips their draws)
    all_rows: bool = False  # the final stage computes every row as an output (llama-cpp-python's logits_all)
    embd: np.ndarray | None = None  # an image's rows for the head to take in place of ``tokens`` (placeholders)
    image: ImageGrid | None = None  # where ``embd``'s rows sit on an M-RoPE image's grid
    prefix_id: str | None = None  # a new session taking this resident prefix's first ``start`` tokens


class Chain:
    """Stage runtimes chained in one process."""

    def __init__(self, configs: Sequence[StageConfig]) -> None:
        self.stages: list[StageRuntime] = []
        try:
            for c in configs:
                self.stages.append(StageRuntime(c))
        except BaseException:
            self.close()
            raise

    @property
    def head(self) -> StageRuntime:
        return self.stages[0]

    def step(self, steps: Sequence[Step], trace: list[list[EntryResult]] | None = None) -> list[EntryResult]:
        """Run one batch through every stage; ``trace`` collects each inner stage's results."""
        entries = [
            BatchEntry(s.session_id, np.arange(s.start, s.start + len(s.tokens)), token_ids=list(s.tokens),
                       hidden=s.embd, fork_of=s.fork_of, image=s.image, prefix_id=s.prefix_id)
            for s in steps
        ]
        results: list[EntryResult] = []
        for index, stage in enumerate(self.stages):
            final = index == len(self.stages) - 1
            if index > 0:
                entries = [
                    BatchEntry(e.session_id, e.positions, token_ids=e.token_ids, hidden=r.hidden, fork_of=e.fork_of,
                               image=e.image, prefix_id=e.prefix_id)
                    for e, r in zip(entries, results)
                ]
            if final:
                entries = [
                    BatchEntry(e.session_id, e.positions, token_ids=e.token_ids, hidden=e.hidden,
                               want_logits=s.want_logits, sample=s.sample, sampling=s.sampling, fork_of=e.fork_of,
                               draws_before=s.draws_before, all_rows=s.all_rows, image=e.image,
                               prefix_id=e.prefix_id)
                    for e, s in zip(entries, steps)
                ]
            results = stage.run_batch(entries)
            if trace is not None and not final:
                trace.append(results)
        return results

    def greedy(self, prompts: dict[str, list[int]], n_tokens: int) -> tuple[dict[str, np.ndarray], dict[str, list[int]]]:
        """Prefill every prompt in one batch, then decode all sessions together, greedily.

        Returns the logits after each prompt and the generated tokens per session.
        """
        results = self.step([Step(sid, 0, toks) for sid, toks in prompts.items()])
        first_logits = {r.session_id: r.logits for r in results}
        generated = {r.session_id: [r.token] for r in results}
        for _ in range(n_tokens - 1):
            steps = [Step(sid, len(prompts[sid]) + len(generated[sid]) - 1, [generated[sid][-1]], want_logits=False)
                     for sid in prompts]
            for r in self.step(steps):
                generated[r.session_id].append(r.token)
        return first_logits, generated

    def drop(self, session_id: str) -> None:
        for stage in self.stages:
            stage.drop_session(session_id)

    def close(self) -> None:
        for stage in self.stages:
            stage.close()
