"""LaneTable: which session holds which llama.cpp sequence, and who is refused.

The reset action stands in for ``llama_memory_seq_rm`` (llama.cpp is not under test
here): a recorder that says yes, no, or raises, lane by lane.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import pytest

from skippy_stage.errors import (
    CapacityError,
    InvalidRequestError,
    PrefixMissError,
    SessionStateError,
    UnknownSessionError,
)
from skippy_stage.model.lanes import Admission, LaneStats, LaneTable


class Resets:
    """Records every reset; ``fail`` maps a lane to how many of its next resets fail."""

    def __init__(self, *, raises: bool = False, delay_s: float = 0.0) -> None:
        self.calls: list[int] = []
        self.fail: dict[int, int] = {}
        self.raises = raises
        self.delay_s = delay_s

    def __call__(self, lane: int) -> bool:
        self.calls.append(lane)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail.get(lane, 0) > 0:
            self.fail[lane] -= 1
            if self.raises:
                raise RuntimeError(f"seq_rm failed on lane {lane}")
            return False
        return True


def make_table(
    *,
    lane_count: int = 4,
    cells_per_lane: int = 100,
    kv_pool_tokens: int | None = None,
    cache_idle_slots: int | None = None,
    reset: Resets | None = None,
) -> tuple[LaneTable, Resets]:
    reset = reset if reset is not None else Resets()
    table = LaneTable(
        lane_count=lane_count,
        cells_per_lane=cells_per_lane,
        kv_pool_tokens=lane_count * cells_per_lane if kv_pool_tokens is None else kv_pool_tokens,
        cache_idle_slots=cache_idle_slots,
        reset=reset,
    )
    return table, reset


def start(table: LaneTable, *session_ids: str, n_tokens: int = 1) -> dict[str, int]:
    """Admit new sessions (position 0) and return their lanes."""
    lanes, _ = table.admit([Admission(s, 0, n_tokens) for s in session_ids])
    return lanes


def states(stats: LaneStats) -> dict[int, str]:
    return {row.lane: row.state for row in stats.lanes}


def assert_no_lane_leaked(table: LaneTable) -> None:
    s = table.stats()
    assert s.free_lanes + s.idle_lanes + s.active_sessions == s.lane_count
    assert sorted(row.lane for row in s.lanes) == list(range(s.lane_count))


def bound(table: LaneTable, session_ids: Iterable[str]) -> list[str]:
    return [s for s in session_ids if table.lane_of(s) is not None]


# -- binding -------------------------------------------------------------------------------


def test_a_new_session_gets_a_lane_and_starts_at_position_zero() -> None:
    table, _ = make_table()

    lanes, new = table.admit([Admission("a", 0, 5)])

    assert lanes == {"a": 0}
    assert new == ["a"]
    assert table.next_position("a") == 0  # nothing is counted until llama.cpp accepts it
    assert table.lane_of("a").lane == 0


def test_sessions_get_distinct_lanes_in_index_order() -> None:
    table, _ = make_table()

    assert start(table, "a", "b", "c") == {"a": 0, "b": 1, "c": 2}


def test_a_bound_session_keeps_its_lane_and_is_not_new() -> None:
    table, _ = make_table()
    start(table, "a")
    table.advance("a", 1)

    lanes, new = table.admit([Admission("a", 1, 1)])

    assert lanes == {"a": 0}
    assert new == []


def test_freed_lane_indices_are_reused() -> None:
    table, _ = make_table(cache_idle_slots=0)
    start(table, "a", "b", "c")

    table.drop("b")

    assert start(table, "d") == {"d": 1}


def test_idle_lanes_are_reused_before_free_ones() -> None:
    table, _ = make_table()
    start(table, "a", "b")

    table.drop("b")

    assert states(table.stats())[1] == "idle"
    assert start(table, "c") == {"c": 1}


def test_idle_pool_is_bounded_by_cache_idle_slots() -> None:
    table, reset = make_table(lane_count=4, cache_idle_slots=1)
    start(table, "a", "b", "c")

    for session_id in ("a", "b", "c"):
        table.drop(session_id)

    s = table.stats()
    assert (s.active_sessions, s.idle_lanes, s.free_lanes) == (0, 1, 3)
    assert states(s) == {0: "idle", 1: "free", 2: "free", 3: "free"}
    assert reset.calls == [0, 1, 2]  # every dropped lane is reset, pooled or not


def test_unset_cache_idle_slots_is_bounded_only_by_lane_count() -> None:
    table, _ = make_table(lane_count=4, cache_idle_slots=None)
    start(table, "a", "b", "c", "d")

    for session_id in ("a", "b", "c", "d"):
        table.drop(session_id)

    s = table.stats()
    assert (s.active_sessions, s.idle_lanes, s.free_lanes) == (0, 4, 0)


# -- failed resets ----------------------------------------------------------------------------


@pytest.mark.parametrize("raises", [False, True], ids=["returns-false", "raises"])
def test_a_lane_whose_reset_fails_is_discarded_not_leaked(raises: bool) -> None:
    table, reset = make_table(lane_count=2, reset=Resets(raises=raises))
    start(table, "a")
    reset.fail[0] = 1

    result = table.drop("a")

    assert result.discarded is True
    s = table.stats()
    assert s.discarded_lanes == 1
    assert (s.active_sessions, s.idle_lanes, s.free_lanes) == (0, 0, 2)
    assert states(s)[0] == "free"  # back on the free list, not in the warm pool
    assert_no_lane_leaked(table)


def test_a_discarded_lane_is_reset_again_before_reuse() -> None:
    table, reset = make_table(lane_count=2)
    start(table, "a")
    reset.fail[0] = 1
    table.drop("a")
    reset.calls.clear()

    lanes = start(table, "b")

    assert lanes == {"b": 0}
    assert reset.calls == [0]


def test_a_discarded_lane_that_still_fails_is_skipped_for_another_free_lane() -> None:
    table, reset = make_table(lane_count=2)
    start(table, "a")
    reset.fail[0] = 2  # the drop's reset and the retry before reuse both fail
    table.drop("a")

    lanes = start(table, "b")

    assert lanes == {"b": 1}
    assert states(table.stats()) == {0: "free", 1: "active"}
    assert_no_lane_leaked(table)


def test_when_the_only_free_lane_cannot_be_reset_all_lanes_are_busy() -> None:
    table, reset = make_table(lane_count=2)
    start(table, "a", "b")
    reset.fail[0] = 2
    table.drop("a")

    with pytest.raises(CapacityError, match="all execution lanes are busy"):
        start(table, "c")

    assert table.lane_of("c") is None
    assert_no_lane_leaked(table)
    reset.fail[0] = 0
    assert start(table, "c") == {"c": 0}  # once the reset works the lane is usable again


def test_a_batch_that_cannot_get_all_its_lanes_rolls_back_the_lanes_it_took() -> None:
    table, reset = make_table(lane_count=3, cache_idle_slots=0)
    start(table, "a", "b", "c")
    reset.fail[1] = 2
    for session_id in ("a", "b"):
        table.drop(session_id)  # lane 0 clean, lane 1 discarded and still broken

    with pytest.raises(CapacityError, match="all execution lanes are busy"):
        start(table, "x", "y")

    assert bound(table, ["x", "y"]) == []
    assert_no_lane_leaked(table)
    assert table.stats().active_sessions == 1


# -- admission: refusals ----------------------------------------------------------------------


def test_admitting_a_session_when_every_lane_is_bound_is_refused() -> None:
    table, _ = make_table(lane_count=2)
    start(table, "a", "b")

    with pytest.raises(CapacityError) as info:
        start(table, "c")

    assert "all execution lanes are busy" in str(info.value)
    assert "lane_count=2" in str(info.value)
    assert table.lane_of("c") is None
    assert table.stats().active_sessions == 2


def test_admission_is_all_or_nothing() -> None:
    table, reset = make_table(lane_count=4)
    start(table, "a", "b")
    reset.calls.clear()

    with pytest.raises(CapacityError, match="all execution lanes are busy"):
        start(table, "x", "y", "z")

    assert bound(table, ["x", "y", "z"]) == []
    s = table.stats()
    assert (s.active_sessions, s.free_lanes + s.idle_lanes) == (2, 2)
    assert reset.calls == []  # refused before any lane was touched


def test_a_session_overflowing_its_lane_is_refused_before_anything_is_bound() -> None:
    table, _ = make_table(cells_per_lane=10)

    with pytest.raises(CapacityError, match="10 KV cells"):
        table.admit([Admission("small", 0, 4), Admission("big", 0, 11)])

    assert bound(table, ["small", "big"]) == []


def test_a_lane_can_be_filled_exactly() -> None:
    table, _ = make_table(cells_per_lane=10)
    start(table, "a", n_tokens=8)
    table.advance("a", 8)

    with pytest.raises(CapacityError, match="would hold 11 tokens"):
        table.admit([Admission("a", 8, 3)])
    lanes, _ = table.admit([Admission("a", 8, 2)])

    assert lanes == {"a": 0}


def test_a_batch_overflowing_the_kv_pool_is_refused_before_anything_is_bound() -> None:
    table, _ = make_table(lane_count=4, cells_per_lane=10, kv_pool_tokens=15)
    start(table, "a", n_tokens=8)
    table.advance("a", 8)

    with pytest.raises(CapacityError, match="kv_pool_tokens=15"):
        table.admit([Admission("b", 0, 4), Admission("c", 0, 4)])

    assert bound(table, ["b", "c"]) == []
    assert table.next_position("a") == 8


def test_a_start_position_other_than_the_next_one_is_out_of_order() -> None:
    table, _ = make_table()
    start(table, "a")
    table.advance("a", 3)

    for wrong in (0, 2, 4):
        with pytest.raises(SessionStateError) as info:
            table.admit([Admission("a", wrong, 1)])
        assert f"positions[0]={wrong}" in str(info.value)
        assert "next position 3" in str(info.value)


def test_an_out_of_order_entry_refuses_the_whole_batch() -> None:
    table, _ = make_table()
    start(table, "a")

    with pytest.raises(SessionStateError):
        table.admit([Admission("new", 0, 1), Admission("a", 5, 1)])

    assert table.lane_of("new") is None


def test_an_unknown_session_cannot_start_past_position_zero() -> None:
    table, _ = make_table()

    with pytest.raises(UnknownSessionError, match="'ghost'"):
        table.admit([Admission("ghost", 7, 1)])

    assert table.stats().active_sessions == 0


def test_unknown_sessions_are_reported_as_such() -> None:
    table, _ = make_table()

    with pytest.raises(UnknownSessionError):
        table.next_position("ghost")
    with pytest.raises(UnknownSessionError):
        table.drop("ghost")
    assert table.lane_of("ghost") is None


def test_a_batch_naming_a_new_session_twice_is_refused_without_binding_a_lane() -> None:
    table, _ = make_table(lane_count=4)

    with pytest.raises(SessionStateError, match="appears twice"):
        table.admit([Admission("a", 0, 1), Admission("a", 0, 1)])

    assert table.stats().active_sessions == 0
    assert_no_lane_leaked(table)


# -- accounting -------------------------------------------------------------------------------


def test_advance_counts_tokens_per_session_and_in_stats() -> None:
    table, _ = make_table()
    start(table, "a", "b")

    table.advance("a", 5)
    table.advance("b", 3)
    table.advance("a", 2)

    assert table.next_position("a") == 7
    assert table.next_position("b") == 3
    s = table.stats()
    assert s.max_session_tokens == 7
    assert s.total_session_tokens == 10


def test_stats_report_lane_count_and_kv_sizes() -> None:
    table, _ = make_table(lane_count=3, cells_per_lane=64, kv_pool_tokens=192, cache_idle_slots=1)

    s = table.stats()

    assert (s.lane_count, s.kv_cells_per_lane, s.kv_pool_tokens) == (3, 64, 192)
    assert (s.active_sessions, s.idle_lanes, s.free_lanes, s.discarded_lanes) == (0, 0, 3, 0)
    assert (s.max_session_tokens, s.total_session_tokens) == (0, 0)


def test_stats_have_one_row_per_lane() -> None:
    table, _ = make_table(lane_count=4, cache_idle_slots=1)
    start(table, "a", "b", "c")
    table.advance("a", 4)
    table.advance("c", 9)
    table.drop("b")

    rows = table.stats().lanes

    assert [(r.lane, r.state, r.session_id, r.n_tokens) for r in rows] == [
        (0, "active", "a", 4),
        (1, "idle", None, 0),
        (2, "active", "c", 9),
        (3, "free", None, 0),
    ]


def test_drop_resets_the_lane_and_reports_the_reset_time() -> None:
    table, reset = make_table(reset=Resets(delay_s=0.02))
    start(table, "a", "b")
    table.advance("b", 6)
    reset.calls.clear()

    result = table.drop("b")

    assert reset.calls == [1]
    assert (result.session_id, result.lane, result.n_tokens, result.discarded) == ("b", 1, 6, False)
    assert result.reset_seconds >= 0.02  # the injected reset's own delay is measured
    assert table.lane_of("b") is None
    assert table.stats().total_session_tokens == 0


def test_a_dropped_session_can_start_again_at_zero() -> None:
    table, _ = make_table()
    start(table, "a")
    table.advance("a", 5)
    table.drop("a")

    start(table, "a")

    assert table.next_position("a") == 0


def test_release_undoes_only_the_fresh_bindings_of_a_batch() -> None:
    table, reset = make_table(lane_count=3)
    start(table, "a")
    table.advance("a", 4)
    reset.calls.clear()

    lanes, new = table.admit([Admission("a", 4, 2), Admission("b", 0, 3)])
    table.release(new)

    assert new == ["b"]
    assert table.lane_of("b") is None
    assert reset.calls == [lanes["b"]]  # whatever the failed decode wrote is cleared
    assert table.next_position("a") == 4
    assert table.stats().active_sessions == 1
    assert_no_lane_leaked(table)


def test_release_ignores_sessions_that_are_not_bound() -> None:
    table, reset = make_table()

    table.release(["ghost"])

    assert reset.calls == []
    assert_no_lane_leaked(table)


def test_idle_sessions_lists_sessions_unused_for_longer_than_the_ttl() -> None:
    table, _ = make_table()
    start(table, "old")
    time.sleep(0.05)
    start(table, "fresh")

    assert table.idle_sessions(older_than_s=0.03) == ["old"]
    assert table.idle_sessions(older_than_s=3600) == []


def test_concurrent_admissions_never_share_a_lane() -> None:
    table, _ = make_table(lane_count=16)
    barrier = threading.Barrier(16)
    got: dict[str, int] = {}
    lock = threading.Lock()

    def admit(i: int) -> None:
        barrier.wait()
        lanes = start(table, f"s{i}")
        with lock:
            got.update(lanes)

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(got.values()) == list(range(16))
    assert table.stats().free_lanes == 0


# -- resident prefixes ----------------------------------------------------------------------


class Trims:
    """Records every trim (lane, keep); ``fail`` holds lanes whose next trim fails."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.fail: set[int] = set()

    def __call__(self, lane: int, keep: int) -> bool:
        self.calls.append((lane, keep))
        if lane in self.fail:
            self.fail.discard(lane)
            return False
        return True


def prefix_table(**kwargs: object) -> tuple[LaneTable, Resets, Trims]:
    reset, trims = Resets(), Trims()
    values: dict = dict(lane_count=4, cells_per_lane=100, kv_pool_tokens=400, cache_idle_slots=None, reset=reset,
                        trim=trims, owner="stage-0")
    values.update(kwargs)
    return LaneTable(**values), reset, trims


def run(table: LaneTable, session_id: str, tokens: int) -> int:
    lanes, _ = table.admit([Admission(session_id, 0, tokens)])
    table.advance(session_id, tokens)
    return lanes[session_id]


def test_a_retired_session_keeps_its_lane_as_a_resident_prefix_a_new_session_takes_in_part():
    table, reset, trims = prefix_table()
    lane = run(table, "turn-1", 30)

    table.retire("turn-1")
    stats = table.stats()
    assert stats.active_sessions == 0 and [(r.prefix_id, r.lane, r.n_tokens) for r in stats.resident] == [("turn-1", lane, 30)]
    assert reset.calls == []  # its KV is kept, not reset

    lanes, new = table.admit([Admission("turn-2", 20, 5, prefix_id="turn-1")])
    assert lanes["turn-2"] == lane and new == ["turn-2"]
    assert trims.calls == [(lane, 20)]  # positions 20.. of the old session are cut away
    table.advance("turn-2", 5)
    assert table.next_position("turn-2") == 25 and table.stats().resident == ()


def test_a_prefix_that_is_not_resident_is_a_miss_and_binds_nothing():
    table, _, _ = prefix_table()
    run(table, "kept", 10)
    table.retire("kept")
    with pytest.raises(PrefixMissError, match=r"prefix miss: prefix_id='gone' is not resident on stage-0"):
        table.admit([Admission("fresh", 0, 3), Admission("next", 4, 2, prefix_id="gone")])
    with pytest.raises(PrefixMissError, match=r"prefix_id='kept' holds 10 tokens on stage-0; positions start at 12"):
        table.admit([Admission("next", 12, 2, prefix_id="kept")])
    stats = table.stats()
    assert stats.active_sessions == 0 and [r.prefix_id for r in stats.resident] == ["kept"]


def test_resident_prefixes_beyond_cache_idle_slots_evict_the_least_recently_used():
    table, reset, _ = prefix_table(cache_idle_slots=2)
    lanes = {sid: run(table, sid, 10) for sid in ("a", "b", "c")}
    for sid in ("a", "b", "c"):
        table.retire(sid)
    assert [r.prefix_id for r in table.stats().resident] == ["b", "c"]
    assert reset.calls == [lanes["a"]]


def test_live_work_evicts_resident_prefixes_for_lanes_and_for_kv_cells():
    table, reset, _ = prefix_table(lane_count=2, kv_pool_tokens=100)
    lanes = {sid: run(table, sid, 40) for sid in ("a", "b")}
    table.retire("a")
    table.retire("b")
    run(table, "c", 10)  # no idle or free lane: the least recently used prefix gives its lane
    assert reset.calls == [lanes["a"]] and [r.prefix_id for r in table.stats().resident] == ["b"]
    table.advance("c", 40)  # c holds 50 cells, b 40: a batch of 20 more needs b's cells
    table.admit([Admission("c", 50, 20)])
    assert reset.calls == [lanes["a"], lanes["b"]] and table.stats().resident == ()


def test_a_resident_prefix_is_dropped_by_its_id():
    table, reset, _ = prefix_table()
    lane = run(table, "a", 10)
    table.retire("a")
    table.drop("a")
    assert reset.calls == [lane] and table.stats().resident == ()


def test_a_prefix_that_cannot_be_cut_is_a_miss_and_its_lane_is_reset():
    table, reset, trims = prefix_table()
    lane = run(table, "a", 10)
    table.retire("a")
    trims.fail.add(lane)
    with pytest.raises(PrefixMissError, match="could not be cut to 4 tokens"):
        table.admit([Admission("b", 4, 2, prefix_id="a")])
    assert reset.calls == [lane] and table.stats().active_sessions == 0 and table.stats().resident == ()


def test_without_a_trim_or_with_no_idle_slots_a_retired_session_is_dropped():
    for kwargs in ({"trim": None}, {"cache_idle_slots": 0}):
        table, reset, _ = prefix_table(**kwargs)
        lane = run(table, "a", 10)
        table.retire("a")
        assert reset.calls == [lane] and table.stats().resident == ()


def test_trim_cuts_a_session_back_and_refuses_a_count_past_what_it_holds():
    table, _, _ = prefix_table()
    run(table, "a", 10)
    assert table.trim("a", 4) == 10
    assert table.next_position("a") == 4
    with pytest.raises(InvalidRequestError, match="tokens=5 for session_id='a': the session holds 4 on stage-0"):
        table.trim("a", 5)
    with pytest.raises(UnknownSessionError):
        table.trim("nobody", 0)


def test_a_fresh_session_never_takes_the_lane_of_a_prefix_the_same_batch_claims():
    """Both lanes resident (P the older): a fresh session and one claiming P arrive together."""
    table, reset, _ = prefix_table(lane_count=2)
    lanes = {sid: run(table, sid, 10) for sid in ("P", "Q")}
    table.retire("P")
    table.retire("Q")
    got, new = table.admit([Admission("fresh", 0, 3), Admission("next", 5, 2, prefix_id="P")])
    assert got["next"] == lanes["P"] and got["fresh"] == lanes["Q"] and sorted(new) == ["fresh", "next"]
    assert reset.calls == [lanes["Q"]] and table.stats().resident == ()


def test_retiring_an_id_that_is_already_resident_frees_the_older_lane():
    table, reset, _ = prefix_table(lane_count=2)
    first = run(table, "X", 10)
    table.retire("X")
    second = run(table, "X", 4)  # the id reused (a fresh lane)
    table.retire("X")
    stats = table.stats()
    assert [(r.prefix_id, r.lane, r.n_tokens) for r in stats.resident] == [("X", second, 4)]
    assert reset.calls == [first] and stats.idle_lanes + stats.free_lanes == 1
