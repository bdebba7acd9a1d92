"""A lane's M-RoPE images: rows in, llama.cpp's model positions out (``model.mrope``).

The layout is libmtmd's (``set_position_mrope_2d``): an image of width x height rows at model
position t puts row k at (t, t + k // width, t + k % width, 0) and the text after it at
t + max(width, height); tests/head/test_images_mrope.py proves a split fed these positions reads
images bit for bit as the unsplit model.
"""

from __future__ import annotations

import numpy as np
import pytest

from skippy_stage.errors import InvalidRequestError
from skippy_stage.model.mrope import ImageGrid, MropeLanes, check_grid


def test_a_lane_without_images_keeps_its_rows_as_positions():
    lanes = MropeLanes()
    assert lanes.sections(0, 5, 3, None, "entries[0]") is None
    assert lanes.model_position(0, 7) == 7
    assert lanes.layout(0, 5) == ()


def test_an_image_sits_on_its_grid_at_its_first_position_and_the_text_after_it_moves_up():
    lanes = MropeLanes()
    image = lanes.sections(2, 4, 15, ImageGrid(5, 3), "entries[0]")
    assert image.tolist() == [[4] * 15,
                              [4 + y for y in range(3) for _ in range(5)],
                              [4 + x for _ in range(3) for x in range(5)],
                              [0] * 15]
    lanes.fed(2, 4, ImageGrid(5, 3), 4)
    # rows 4..18 hold the image on positions 4..8; the text's first row (19) is at 9
    text = lanes.sections(2, 19, 3, None, "entries[0]")
    assert text.tolist() == [[9, 10, 11], [9, 10, 11], [9, 10, 11], [0, 0, 0]]
    assert [lanes.model_position(2, row) for row in (0, 4, 5, 18, 19, 25)] == [0, 4, None, None, 9, 15]
    assert lanes.layout(2, 25) == ((4, 5, 3),) and lanes.layout(1, 25) == ()
    assert lanes.layout(2, 10) is None  # a page of 10 rows would hold part of the image


def test_an_image_in_slices_continues_on_its_grid_and_a_second_image_starts_after_the_first():
    lanes = MropeLanes()
    first = lanes.sections(0, 0, 6, ImageGrid(4, 2), "entries[0]")
    lanes.fed(0, 0, ImageGrid(4, 2), 0)
    rest = lanes.sections(0, 6, 2, ImageGrid(4, 2, first_row=6), "entries[0]")
    lanes.fed(0, 6, ImageGrid(4, 2, first_row=6), 0)
    whole = np.concatenate([first, rest], axis=1)
    assert whole.tolist() == [[0] * 8, [0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 2, 3] * 2, [0] * 8]
    # 8 rows on 4 positions, then 2 rows of text (positions 4, 5), then a 2x3 image at position 6
    lanes.fed(0, 10, ImageGrid(2, 3), int(lanes.sections(0, 10, 6, ImageGrid(2, 3), "e")[0, 0]))
    assert lanes.sections(0, 16, 1, None, "e")[0].tolist() == [6 + 3]
    assert lanes.model_position(0, 10) == 6


def test_entries_that_do_not_continue_the_lanes_images_are_refused_by_name():
    lanes = MropeLanes()
    with pytest.raises(InvalidRequestError, match=r"entries\[1\]\.image\.first_row=2: this session has no 4x2 image "
                                                  r"begun at row 3"):
        lanes.sections(0, 5, 2, ImageGrid(4, 2, first_row=2), "entries[1]")
    lanes.fed(0, 3, ImageGrid(4, 2), 3)  # rows 3..4 fed of 3..10
    with pytest.raises(InvalidRequestError, match=r"entries\[0\] starts at row 5, inside the image at rows 3\.\.11"):
        lanes.sections(0, 5, 1, None, "entries[0]")
    with pytest.raises(InvalidRequestError, match=r"first_row=2: this session has no 2x4 image"):
        lanes.sections(0, 5, 2, ImageGrid(2, 4, first_row=2), "entries[0]")
    with pytest.raises(InvalidRequestError, match=r"entries\[0\] starts at row 5, inside the image"):
        lanes.sections(0, 5, 2, ImageGrid(2, 2), "entries[0]")


def test_a_cut_keeps_the_images_before_it_a_copy_takes_them_along_and_a_reset_forgets_them():
    lanes = MropeLanes()
    lanes.fed(0, 2, ImageGrid(3, 3), 2)
    lanes.fed(0, 14, ImageGrid(2, 2), 8)
    lanes.copy(0, 1)
    lanes.cut(0, 14)
    assert lanes.model_position(0, 14) == 8 and lanes.model_position(0, 16) == 10  # the second image gone
    assert lanes.model_position(1, 16) is None and lanes.model_position(1, 18) == 10  # the copy kept both
    lanes.cut(1, 2)
    assert lanes.layout(1, 2) == ()
    lanes.forget(0)
    assert lanes.model_position(0, 14) == 14
    lanes.copy(3, 0)  # a copy of a lane without images leaves none
    assert lanes.layout(0, 16) == ()


@pytest.mark.parametrize(("grid", "n", "message"), [
    (ImageGrid(0, 3), 1, r"is 0x3: each side must be in \[1, 4096\]"),
    (ImageGrid(4097, 1), 1, r"is 4097x1: each side"),
    (ImageGrid(100, 100), 1, r"is 100x100 = 10000 rows; at most 4096"),
    (ImageGrid(5, 3, first_row=14), 2, r"first_row=14 with 2 rows passes the image's 15 rows"),
])
def test_a_grid_an_entry_cannot_be_is_refused_naming_it(grid, n, message):
    with pytest.raises(InvalidRequestError, match=r"entries\[2\]\.image" + ".*" + message):
        check_grid(grid, n, "entries[2]")
