"""The order in which llama.cpp computes the tokens of one ``llama_decode`` batch.

Hidden states captured by the eval callback arrive in *compute* order, one graph per
micro-batch (ubatch), not in the order of the batch we built. llama.cpp splits a batch
in one of two ways (``llama_batch_allocr::split_simple`` / ``split_equal``, as chosen in
``llama_kv_cache::init_batch``):

* one KV stream (``kv_unified`` or a single lane): consecutive chunks of ``n_ubatch``
  tokens, so compute order is batch order;
* one stream per lane: "equal" splits, each taking the same number of tokens from a run of
  consecutive sequence ids, concatenated sequence by sequence.

This module mirrors that policy for batches where every token belongs to one sequence,
so the runtime can put each captured row back under its token. The runtime checks the
predicted row count of every micro-batch against what the callback saw and fails loudly
on any disagreement, rather than forwarding rows under the wrong tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


def in_batch_order(seq_ids: Sequence[int]) -> bool:
    """Whether an equal split computes these tokens in batch order: one sequence only (its
    micro-batches are then consecutive chunks of ``n_ubatch``, as in a simple split)."""
    first = seq_ids[0] if len(seq_ids) else 0
    return all(seq == first for seq in seq_ids)


def compute_order(seq_ids: Sequence[int], n_ubatch: int, *, equal_split: bool) -> list[list[int]]:
    """Batch indices of each micro-batch, in the order llama.cpp computes them."""
    n = len(seq_ids)
    if not equal_split:
        return [list(range(start, min(start + n_ubatch, n))) for start in range(0, n, n_ubatch)]

    per_seq: dict[int, list[int]] = {}
    for index, seq in enumerate(seq_ids):
        per_seq.setdefault(seq, []).append(index)
    taken = dict.fromkeys(per_seq, 0)
    used = [False] * n
    ubatches: list[list[int]] = []
    while not all(used):
        # Sequences join in order of their first unused token, only as a run of consecutive ids.
        chosen: list[int] = []
        for index in range(n):
            if used[index]:
                continue
            seq = seq_ids[index]
            if seq in chosen or (chosen and seq != chosen[-1] + 1):
                continue
            chosen.append(seq)
            if len(chosen) > n_ubatch:
                break
        rows: list[list[int]] = [[] for _ in chosen]
        while all(taken[seq] < len(per_seq[seq]) for seq in chosen):
            for slot, seq in enumerate(chosen):
                index = per_seq[seq][taken[seq]]
                rows[slot].append(index)
                used[index] = True
                taken[seq] += 1
            if (len(rows[0]) + 1) * len(chosen) > n_ubatch:
                break
        ubatches.append([index for group in rows for index in group])
    return ubatches
