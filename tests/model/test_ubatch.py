"""compute_order: the order in which llama.cpp computes the tokens of one batch.

The expected outputs below are worked by hand from llama.cpp's
``llama_batch_allocr::split_simple`` and ``split_equal(n_ubatch, sequential=true)``
(vendored ``src/llama-batch.cpp``), which the runtime relies on to put captured
hidden-state rows back under their tokens:

* split_equal picks, in order of each sequence's first unused token, a run of
  *consecutive* sequence ids (a sequence id that is not the previous one + 1 waits for a
  later micro-batch);
* it then takes one token from every chosen sequence per round, while every chosen
  sequence still has a token and ``(rounds + 1) * n_seqs <= n_ubatch``;
* the micro-batch is the chosen sequences' tokens concatenated sequence by sequence.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from skippy_stage.model.ubatch import compute_order


def assert_each_index_once(seq_ids: Sequence[int], ubatches: list[list[int]]) -> None:
    flat = [i for u in ubatches for i in u]
    assert sorted(flat) == list(range(len(seq_ids)))


# -- one KV stream: simple split ---------------------------------------------------------


@pytest.mark.parametrize(
    ("seq_ids", "n_ubatch", "expected"),
    [
        ([0, 0, 1, 1, 1], 2, [[0, 1], [2, 3], [4]]),
        ([0, 0, 1, 1, 1], 5, [[0, 1, 2, 3, 4]]),
        ([0, 0, 1, 1, 1], 512, [[0, 1, 2, 3, 4]]),
        ([3, 1, 2], 1, [[0], [1], [2]]),
        ([0] * 7, 3, [[0, 1, 2], [3, 4, 5], [6]]),
    ],
)
def test_simple_split_is_batch_order_in_chunks_of_n_ubatch(
    seq_ids: list[int], n_ubatch: int, expected: list[list[int]]
) -> None:
    assert compute_order(seq_ids, n_ubatch, equal_split=False) == expected


@pytest.mark.parametrize("equal_split", [False, True])
def test_an_empty_batch_has_no_micro_batches(equal_split: bool) -> None:
    assert compute_order([], 4, equal_split=equal_split) == []


# -- one KV stream per lane: equal split ----------------------------------------------------


def test_equal_split_of_one_sequence_is_batch_order() -> None:
    assert compute_order([0, 0, 0, 0, 0], 512, equal_split=True) == [[0, 1, 2, 3, 4]]


def test_equal_split_of_one_sequence_is_chunked_by_n_ubatch() -> None:
    # One sequence: rounds stop once (rounds + 1) * 1 > 2.
    assert compute_order([2, 2, 2, 2, 2], 2, equal_split=True) == [[0, 1], [2, 3], [4]]


def test_equal_split_takes_equal_shares_and_defers_the_longer_sequences_tail() -> None:
    # Sequences 0 (indices 0,1,2) and 1 (3,4): two rounds exhaust sequence 1, so the
    # first micro-batch is 0,1 | 3,4 and index 2 is computed alone afterwards.
    seq_ids = [0, 0, 0, 1, 1]

    ubatches = compute_order(seq_ids, 512, equal_split=True)

    assert ubatches == [[0, 1, 3, 4], [2]]
    assert_each_index_once(seq_ids, ubatches)


def test_equal_split_of_one_token_per_lane_is_one_micro_batch() -> None:
    # The decode step of three lanes.
    assert compute_order([0, 1, 2], 512, equal_split=True) == [[0, 1, 2]]


def test_equal_split_need_not_start_at_sequence_zero() -> None:
    # Sequences 1 (0,1) and 2 (2): one round exhausts sequence 2.
    assert compute_order([1, 1, 2], 512, equal_split=True) == [[0, 2], [1]]


def test_equal_split_keeps_non_consecutive_sequence_ids_apart() -> None:
    # Sequence 2 is not 0 + 1, so it waits for the next micro-batch.
    seq_ids = [0, 0, 2, 2]

    ubatches = compute_order(seq_ids, 512, equal_split=True)

    assert ubatches == [[0, 1], [2, 3]]
    assert_each_index_once(seq_ids, ubatches)


def test_equal_split_joins_sequences_in_order_of_first_token_while_ids_stay_consecutive() -> None:
    # Scan: 0 joins; 2 is refused (not 0+1); 1 joins; 0 is taken; 2 now joins (1+1).
    # Per sequence: 0 -> 0,3   2 -> 1,4   1 -> 2,5; concatenated in the order they joined.
    seq_ids = [0, 2, 1, 0, 2, 1]

    ubatches = compute_order(seq_ids, 512, equal_split=True)

    assert ubatches == [[0, 3, 2, 5, 1, 4]]
    assert_each_index_once(seq_ids, ubatches)


def test_equal_split_with_a_gap_at_the_start_runs_the_later_sequences_separately() -> None:
    # Sequence 3 joins first; 1 is refused (not 3+1) and leads the next micro-batch with 2.
    seq_ids = [3, 1, 2, 3]

    ubatches = compute_order(seq_ids, 512, equal_split=True)

    assert ubatches == [[0, 3], [1, 2]]
    assert_each_index_once(seq_ids, ubatches)


def test_equal_split_stops_rounds_when_the_next_would_exceed_n_ubatch() -> None:
    # Two sequences of three: after 2 rounds (4 tokens) a third round would need 6 > 4.
    seq_ids = [0, 0, 0, 1, 1, 1]

    ubatches = compute_order(seq_ids, 4, equal_split=True)

    assert ubatches == [[0, 1, 3, 4], [2, 5]]
    assert_each_index_once(seq_ids, ubatches)


def test_equal_split_with_an_odd_n_ubatch_rounds_down_to_whole_rounds() -> None:
    # n_ubatch 3 with two sequences: one round (2 tokens), since two rounds need 4 > 3.
    seq_ids = [0, 0, 0, 1, 1, 1]

    ubatches = compute_order(seq_ids, 3, equal_split=True)

    assert ubatches == [[0, 3], [1, 4], [2, 5]]
    assert all(len(u) <= 3 for u in ubatches)


def test_equal_split_of_unequal_sequences_under_a_small_n_ubatch() -> None:
    # 0 -> 0,1,2,3   1 -> 4   2 -> 5,6 with n_ubatch 4.
    # ubatch 1: sequences 0,1,2 join; one round (two would need 6 > 4): 0 | 4 | 5
    # ubatch 2: 0 joins; 1 is done, so 2 is refused (not 0+1): sequence 0 alone, while
    #           (r+1) * 1 <= 4 and tokens remain: 1,2,3
    # ubatch 3: 6
    seq_ids = [0, 0, 0, 0, 1, 2, 2]

    ubatches = compute_order(seq_ids, 4, equal_split=True)

    assert ubatches == [[0, 4, 5], [1, 2, 3], [6]]
    assert_each_index_once(seq_ids, ubatches)


@pytest.mark.parametrize("n_ubatch", [1, 2, 3, 4, 5, 8, 64])
@pytest.mark.parametrize(
    "seq_ids",
    [
        [0, 0, 0, 1, 1, 2, 2, 2, 2],
        [3, 3, 0, 1, 1, 1, 2, 5, 5, 4],
        [1, 0, 1, 0, 1, 0],
        [7] * 9,
    ],
)
def test_equal_split_computes_every_token_once_within_n_ubatch(seq_ids: list[int], n_ubatch: int) -> None:
    lanes = len(set(seq_ids))
    ubatches = compute_order(seq_ids, n_ubatch, equal_split=True)

    assert_each_index_once(seq_ids, ubatches)
    if lanes <= n_ubatch:  # the config guarantees lane_count <= n_ubatch
        assert all(1 <= len(u) <= n_ubatch for u in ubatches)
    for u in ubatches:
        # Within one micro-batch each sequence keeps its own token order.
        for seq in {seq_ids[i] for i in u}:
            mine = [i for i in u if seq_ids[i] == seq]
            assert mine == sorted(mine)


def _split_equal_reference(seq_ids: Sequence[int], n_ubatch: int) -> list[list[int]]:
    """A line-by-line transliteration of llama.cpp's split_equal(n_ubatch, sequential=true,
    n_keep_tail=0) for single-sequence tokens, called until it returns an empty ubatch."""
    n = len(seq_ids)
    used = [False] * n
    seq_set_map: dict[int, list[int]] = {}
    for i, s in enumerate(seq_ids):
        seq_set_map.setdefault(s, []).append(i)
    out: list[list[int]] = []
    while True:
        cur_seq_set: list[int] = []
        last_seq_id = -1
        for i in range(n):
            if used[i]:
                continue
            add = seq_ids[i] not in cur_seq_set
            add = add and (not cur_seq_set or seq_ids[i] == last_seq_id + 1)
            if add:
                cur_seq_set.append(seq_ids[i])
                last_seq_id = seq_ids[i]
                if len(cur_seq_set) > n_ubatch:
                    break
        n_seqs = len(cur_seq_set)
        if n_seqs == 0:
            return out
        cur_idx = [0] * n_seqs
        for s in range(n_seqs):
            while used[seq_set_map[cur_seq_set[s]][cur_idx[s]]]:
                cur_idx[s] += 1
        idxs_per_seq: list[list[int]] = [[] for _ in range(n_seqs)]
        while True:
            if any(cur_idx[s] >= len(seq_set_map[cur_seq_set[s]]) for s in range(n_seqs)):
                break
            for s in range(n_seqs):
                idx = seq_set_map[cur_seq_set[s]][cur_idx[s]]
                idxs_per_seq[s].append(idx)
                used[idx] = True
                cur_idx[s] += 1
            if (len(idxs_per_seq[0]) + 1) * n_seqs > n_ubatch:
                break
        out.append([i for idxs in idxs_per_seq for i in idxs])


def test_equal_split_matches_a_transliteration_of_llama_cpp_on_random_batches() -> None:
    rng = random.Random(20240601)
    for _ in range(500):
        lanes = rng.randint(1, 6)
        n_ubatch = rng.randint(lanes, 12)  # the config guarantees lane_count <= n_ubatch
        seq_ids = [rng.randrange(lanes) for _ in range(rng.randint(1, 24))]
        if rng.random() < 0.5:  # the runtime builds batches grouped by lane
            seq_ids.sort()

        assert compute_order(seq_ids, n_ubatch, equal_split=True) == _split_equal_reference(seq_ids, n_ubatch), (
            seq_ids,
            n_ubatch,
        )


def test_one_sequence_is_computed_in_batch_order_by_either_split() -> None:
    """A single-stream decode's batch holds one sequence: its rows come back in batch order, so
    the runtime copies them as they are (no reordering on the hot path)."""
    from skippy_stage.model.ubatch import in_batch_order

    assert in_batch_order([3, 3, 3]) and in_batch_order([0])
    assert not in_batch_order([0, 1]) and not in_batch_order([1, 1, 0])
    for n in range(1, 20):
        for n_ubatch in (1, 3, 8, 512):
            chunks = compute_order([2] * n, n_ubatch, equal_split=False)
            assert compute_order([2] * n, n_ubatch, equal_split=True) == chunks == _split_equal_reference([2] * n,
                                                                                                           n_ubatch)
