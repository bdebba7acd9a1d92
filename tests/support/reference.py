"""llama-cpp-python's own ``Llama`` on the unsplit model, fed the batches a chain is fed.

The independent reference of the exactness tests: no stage runtime, no eval callback, the
context the stages make (``loader.reference_llama_like``: loaded as stages load, the same
``ctx_size``, lanes, ``kv_unified``, batch sizes). Every row of every batch is an output
(``logits_all``), and the chain's final stage is asked for every row too (``all_rows``): the
rows asked for change the last layer's batch shape, and kernels differ between one-row and
larger batches on some CPUs. (Where micro-batches are smaller than a prompt, stages output
at most ``n_ubatch`` rows per batch: there both sides output each session's last row only.) One session goes through ``Llama.eval`` (the prompt in
``n_batch`` chunks, then one ``eval([token])`` per step); several sessions in one batch go
through ``llama_cpp.llama_decode`` on the same ``Llama``'s context, each session on the
sequence id of its lane in the chain, in the chain's row order (by lane).
"""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp
import numpy as np

from skippy_stage.config import StageConfig
from skippy_stage.model.chain import Chain, Step
from skippy_stage.model.loader import reference_llama_like

__all__ = ["Reference", "chain_greedy", "max_diff"]


class Reference:
    """llama-cpp-python on the whole model with ``cfg``'s context."""

    def __init__(self, cfg: StageConfig, model_path: str | None = None) -> None:
        self.llm = reference_llama_like(cfg, model_path)
        self.n_vocab = self.llm.n_vocab()

    def close(self) -> None:
        self.llm.close()

    def greedy_alone(self, prompt: list[int], n_tokens: int) -> tuple[list[np.ndarray], list[int]]:
        """``Llama.eval`` of the prompt, then of each greedy token: each step's last row and the tokens."""
        llm = self.llm
        llm.reset()  # the next eval removes every cell from position 0 on
        llm.eval(prompt)
        rows = [np.array(llm.scores[len(prompt) - 1], dtype=np.float32)]
        tokens = [int(np.argmax(rows[-1]))]
        while len(tokens) < n_tokens:
            llm.eval([tokens[-1]])
            rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
            tokens.append(int(np.argmax(rows[-1])))
        return rows, tokens

    def decode(self, entries: Sequence[tuple[int, int, Sequence[int]]], all_rows: bool = True) -> list[np.ndarray]:
        """One ``llama_decode`` of ``(sequence, start, tokens)`` entries in this order, every row an
        output (or only each entry's last, ``all_rows=False``); each entry's last row of logits."""
        n = sum(len(tokens) for _, _, tokens in entries)
        batch = llama_cpp.llama_batch_init(n, 0, 1)
        try:
            i = 0
            last = []
            for seq, start, tokens in entries:
                for j, token in enumerate(tokens):
                    batch.token[i] = int(token)
                    batch.pos[i] = start + j
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq
                    batch.logits[i] = 1 if all_rows or j == len(tokens) - 1 else 0
                    i += 1
                last.append(i - 1)
            batch.n_tokens = n
            rc = llama_cpp.llama_decode(self.llm.ctx, batch)
            assert rc == 0, f"llama_decode returned {rc}"
            return [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, row),
                                          shape=(self.n_vocab,)).copy() for row in last]
        finally:
            llama_cpp.llama_batch_free(batch)

    def greedy_together(self, prompts: dict[str, list[int]], lanes: dict[str, int],
                        n_tokens: int, all_rows: bool = True) -> tuple[dict[str, list[np.ndarray]], dict[str, list[int]]]:
        """Every prompt in one batch, then one greedy token per session per batch, rows ordered by lane."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm.ctx), True)
        order = sorted(prompts, key=lanes.__getitem__)
        rows: dict[str, list[np.ndarray]] = {sid: [] for sid in order}
        tokens: dict[str, list[int]] = {sid: [] for sid in order}
        feeds = {sid: (0, prompts[sid]) for sid in order}
        for _ in range(n_tokens):
            out = self.decode([(lanes[sid], *feeds[sid]) for sid in order], all_rows)
            for sid, row in zip(order, out):
                rows[sid].append(row)
                tokens[sid].append(int(np.argmax(row)))
                feeds[sid] = (len(prompts[sid]) + len(tokens[sid]) - 1, [tokens[sid][-1]])
        return rows, tokens


def chain_greedy(chain: Chain, prompts: dict[str, list[int]], n_tokens: int, all_rows: bool = True,
                 ) -> tuple[dict[str, list[np.ndarray]], dict[str, list[int]], dict[str, int]]:
    """Like ``Chain.greedy``, with every row an output (unless ``all_rows=False``: each session's last
    only) and every step's logits kept: each session's rows, its tokens and the lane the final stage
    gave it."""
    results = chain.step([Step(sid, 0, toks, all_rows=all_rows) for sid, toks in prompts.items()])
    rows = {r.session_id: [r.logits] for r in results}
    generated = {r.session_id: [r.token] for r in results}
    for _ in range(n_tokens - 1):
        steps = [Step(sid, len(prompts[sid]) + len(generated[sid]) - 1, [generated[sid][-1]], all_rows=all_rows)
                 for sid in prompts]
        for r in chain.step(steps):
            rows[r.session_id].append(r.logits)
            generated[r.session_id].append(r.token)
    lanes = {row.session_id: row.lane for row in chain.stages[-1].stats().lanes if row.session_id in prompts}
    return rows, generated, lanes


def max_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """The largest |difference| over rows of logits (inf when the row counts differ)."""
    if len(a) != len(b):
        return float("inf")
    return max(float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()) for x, y in zip(a, b))
