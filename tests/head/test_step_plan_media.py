"""How the head cuts a prompt with images into steps (``step_plan``): text and each image's rows in
entries of their own, the rows carried beside placeholder tokens, the same after a recovery's replay
and for n choices that fork at the prompt's last position. Bookkeeping alone: no model, no chain."""

from __future__ import annotations

import numpy as np

from skippy_stage.head.prefixes import PrefixCache
from skippy_stage.head.step_plan import image_start, plan_step
from skippy_stage.head.tasks import Task
from skippy_stage.model.mrope import ImageGrid
from skippy_stage.model.projector import PLACEHOLDER_TOKEN, MediaSpan, media_keys
from skippy_stage.model.sampling import SamplingParams

N_EMBD = 8


def image_task(text_before: int, rows: int, text_after: int, *, session: str = "s",
               grid: tuple[int, int] | None = None) -> Task:
    """A prompt of ``text_before`` tokens, an image of ``rows`` rows (on an M-RoPE ``grid``), then
    ``text_after`` tokens."""
    image = np.arange(rows * N_EMBD, dtype=np.float32).reshape(rows, N_EMBD)
    span = MediaSpan(text_before, image, "ab" * 32, media_keys("ab" * 32, rows), grid=grid)
    prompt = [*range(10, 10 + text_before), *span.key, *range(100, 100 + text_after)]
    return Task(session_id=session, prompt=prompt, sampling=SamplingParams(), max_tokens=4, media=(span,))


def plan(task: Task, n_ubatch: int = 512):
    return plan_step([task], n_batch=512, n_ubatch=n_ubatch, max_context=10_000)


def feed_all(task: Task, n_ubatch: int = 512) -> list:
    """Every prefill entry until the prompt is fed (each step's outputs taken as prefill progress)."""
    entries = []
    while task.prefilled < len(task.to_feed):
        (entry,), ((_, n),) = plan(task, n_ubatch)
        entries.append(entry)
        task.prefilled += n
    return entries


def test_text_and_an_image_go_in_entries_of_their_own_the_image_as_rows_beside_placeholders():
    task = image_task(5, 16, 7)
    entries = feed_all(task)
    assert [(e.positions[0], len(e.positions)) for e in entries] == [(0, 5), (5, 16), (21, 7)]
    text, image, after = entries
    assert text.embd is None and list(text.token_ids) == list(range(10, 15))
    assert list(image.token_ids) == [PLACEHOLDER_TOKEN] * 16
    assert np.array_equal(image.embd, task.media[0].rows)
    assert after.embd is None and after.sample_last and not text.sample_last and not image.sample_last


def test_an_image_longer_than_a_micro_batch_is_fed_in_consecutive_slices_of_its_rows():
    task = image_task(3, 20, 2)
    entries = feed_all(task, n_ubatch=8)
    assert [(e.positions[0], len(e.positions)) for e in entries] == [(0, 3), (3, 8), (11, 8), (19, 4), (23, 2)]
    assert np.array_equal(np.concatenate([e.embd for e in entries[1:4]]), task.media[0].rows)


def test_a_recovery_replays_the_image_as_rows_where_the_prompt_holds_its_keys():
    task = image_task(4, 6, 3)
    feed_all(task)
    task.replay = [*task.prompt, 7, 8]  # the prompt and two generated tokens, fed again
    task.prefilled = 0
    entries = feed_all(task)
    image = next(e for e in entries if e.embd is not None)
    assert (image.positions[0], len(image.positions)) == (4, 6)
    assert np.array_equal(image.embd, task.media[0].rows)
    assert all(t >= 0 for e in entries for t in e.token_ids)  # the keys never leave the head


def test_a_prompt_that_ends_in_an_image_forks_its_choices_on_the_image_last_row():
    source, fork = image_task(4, 6, 0, session="a"), image_task(4, 6, 0, session="b")
    source.forks, fork.fork_from, source.hold_at = [fork], source, len(source.prompt) - 1
    while source.prefilled < source.hold_at:
        entries, steps = plan_step([source, fork], n_batch=512, n_ubatch=512, max_context=10_000)
        for task, n in steps:
            task.prefilled += n
    entries, _ = plan_step([source, fork], n_batch=512, n_ubatch=512, max_context=10_000)
    assert [e.fork_of for e in entries] == [None, "a"]
    for entry in entries:
        assert list(entry.positions) == [9] and list(entry.token_ids) == [PLACEHOLDER_TOKEN]
        assert np.array_equal(entry.embd, source.media[0].rows[-1:])


def test_an_m_rope_image_s_slices_carry_its_grid_and_their_first_row_on_it():
    task = image_task(3, 20, 2, grid=(5, 4))
    entries = feed_all(task, n_ubatch=8)
    assert [e.image for e in entries] == [None, ImageGrid(5, 4, 0), ImageGrid(5, 4, 8), ImageGrid(5, 4, 16), None]
    assert all(e.image is None for e in feed_all(image_task(3, 20, 2), n_ubatch=8))  # an mlp image has no grid


def test_a_resident_prefix_is_kept_only_up_to_an_m_rope_image_s_start_when_it_ends_inside_one():
    """A cut strictly inside an M-RoPE image has no model position: a match that ends there keeps
    what comes before the image (an mlp image's rows are positions: kept as matched)."""
    mrope, plain = image_task(4, 6, 3, grid=(3, 2)), image_task(4, 6, 3)
    assert [image_start(mrope, row) for row in (3, 4, 5, 9, 10)] == [3, 4, 4, 4, 10]
    assert [image_start(plain, row) for row in (5, 9)] == [5, 9]
    cache = PrefixCache(2)
    cache.add("p", mrope.prompt[:7])  # a prefix that holds half the image
    assert cache.claim(mrope.prompt, fit=lambda n: image_start(mrope, n)).reuse == 4
    cache.add("q", plain.prompt[:7])
    assert cache.claim(plain.prompt, fit=lambda n: image_start(plain, n)).reuse == 7
