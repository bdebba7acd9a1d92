"""How many batches the head keeps in flight (``head.inflight.BatchCount``), from a step's measured
time and the ring's measured link latency: one where the links are a small part of a step, more
where they leave the compute idle, about one per stage where each stage has cores of its own."""

from __future__ import annotations

from skippy_stage.head.inflight import BatchCount


def count(step_ms: float, ring_ms: float, *, shared: bool = True, stages: int = 3, cap: int = 4) -> int:
    batches = BatchCount(cap=cap, stages=stages, shared_cores=shared, ring_s=lambda: ring_ms / 1e3)
    if step_ms:
        batches.step(step_ms / 1e3)
    return batches.count()


def test_one_batch_until_a_step_and_the_links_are_measured():
    assert count(0, 30) == 1
    assert count(100, 0) == 1


def test_stages_sharing_the_cores_keep_one_batch_on_loopback_and_two_where_links_leave_them_idle():
    assert count(100, 1.5) == 1, "loopback: the links are 1.5 % of a step"
    assert count(95, 6) == 1, "2 ms links: 6 % of a step does not pay a split"
    assert count(96, 32) == 2, "10 ms links: a third of the step is the ring's"
    assert count(100, 70) == 4, "links most of a step: up to the cap"
    assert count(100, 70, cap=2) == 2


def test_stages_on_hosts_of_their_own_keep_about_one_batch_per_stage():
    assert count(60, 1.5, shared=False) == 3
    assert count(60, 1.5, shared=False, stages=2) == 2
    assert count(90, 30, shared=False, cap=8) == 5, "and more where the links leave every stage idle"


def test_max_inflight_one_is_one_batch_whatever_is_measured():
    assert count(100, 90, cap=1) == 1
    assert count(100, 90, shared=False, cap=1) == 1


def test_a_ring_measured_longer_than_a_step_still_gives_a_bounded_count():
    assert count(10, 50) == 4
    assert count(10, 50, cap=3) == 3
