"""M-RoPE images (Qwen2-VL and kin): a session's rows and its model positions apart.

A Qwen2-VL projector makes an image a grid of ``width`` x ``height`` rows (merged patches, raster
order) that takes ``max(width, height)`` model positions, not one per row: every row has the image's
first position ``t`` in section 0, ``t + y`` in section 1, ``t + x`` in section 2 and 0 in section 3
(libmtmd's ``set_position_mrope_2d``), and the text after the image starts ``max(width, height)``
positions on. Everything else in this project counts rows: a session's positions on the wire, a lane's
KV cells, trims, forks and resident prefixes. So each stage keeps, per lane, where the images its KV
holds are, and turns rows into model positions only at llama.cpp's edge: the batch's positions and
``seq_rm``/``seq_cp`` cuts. A cut strictly inside an image has no model position (its rows share
``t``, and llama.cpp cuts by position), so it is refused; the head never asks for one.

Every stage sees every entry, so every stage keeps the same images per session without any of them
travelling beyond the entry that starts each (``ImageGrid``). No llama.cpp, no locks: the runtime
calls it under its compute lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from skippy_stage.errors import InvalidRequestError

# The most rows an image entry may name (libmtmd's default cap on a Qwen2-VL image; a head's
# image_max_tokens may not pass it), and the longest side.
MAX_GRID_SIDE = 4096
MAX_GRID_ROWS = 4096


@dataclass(frozen=True, slots=True)
class ImageGrid:
    """An entry's rows within one M-RoPE image: the image's grid and the entry's first row in it
    (an image longer than a batch goes in slices, each an entry of its own)."""

    width: int
    height: int
    first_row: int = 0

    @property
    def rows(self) -> int:
        return self.width * self.height

    @property
    def n_pos(self) -> int:
        return max(self.width, self.height)


def check_grid(grid: object, n: int, where: str) -> None:
    """Refuse a grid an entry of ``n`` rows cannot be, naming the field."""
    if not isinstance(grid, ImageGrid):
        raise InvalidRequestError(f"{where}.image must be an ImageGrid")
    if not (1 <= grid.width <= MAX_GRID_SIDE and 1 <= grid.height <= MAX_GRID_SIDE):
        raise InvalidRequestError(f"{where}.image is {grid.width}x{grid.height}: each side must be in "
                                  f"[1, {MAX_GRID_SIDE}]")
    if grid.rows > MAX_GRID_ROWS:
        raise InvalidRequestError(f"{where}.image is {grid.width}x{grid.height} = {grid.rows} rows; at most "
                                  f"{MAX_GRID_ROWS}")
    if not 0 <= grid.first_row or grid.first_row + n > grid.rows:
        raise InvalidRequestError(f"{where}.image.first_row={grid.first_row} with {n} rows passes the image's "
                                  f"{grid.rows} rows")


@dataclass(frozen=True, slots=True)
class _Image:
    start: int  # the session's row it starts at
    width: int
    height: int
    t: int  # its model position (every row's section 0)

    @property
    def end(self) -> int:
        return self.start + self.width * self.height

    @property
    def after(self) -> int:
        """The model position of the row after it."""
        return self.t + max(self.width, self.height)


class MropeLanes:
    """Per lane, the M-RoPE images its KV holds, oldest first."""

    def __init__(self) -> None:
        self._images: dict[int, tuple[_Image, ...]] = {}

    def model_position(self, lane: int, row: int) -> int | None:
        """The model position a cut before ``row`` removes from; None strictly inside an image."""
        images = self._images.get(lane, ())
        if not images:
            return row
        shift = 0
        for image in images:
            if row <= image.start:
                break
            if row < image.end:
                return None
            shift += image.width * image.height - max(image.width, image.height)
        return row - shift

    def image_start(self, lane: int, row: int) -> int:
        """The first row of the image ``row`` falls in (``row`` itself outside every image)."""
        for image in self._images.get(lane, ()):
            if image.start <= row < image.end:
                return image.start
        return row

    def sections(self, lane: int, start: int, n: int, grid: ImageGrid | None, where: str) -> np.ndarray | None:
        """The 4 x ``n`` model positions (section-major) of an entry's rows ``start .. start + n`` on
        ``lane`` (which holds ``start`` rows), or None where they are the rows' own (no image held or
        fed). Refuses an entry that does not continue the lane's images, naming it."""
        images = self._images.get(lane, ())
        last = images[-1] if images else None
        if last is not None and last.end > start and not (grid is not None and grid.first_row > 0):
            raise InvalidRequestError(f"{where} starts at row {start}, inside the image at rows {last.start}.."
                                      f"{last.end} this session has not finished")
        if grid is None:
            if not images:
                return None
            t = np.arange(n, dtype=np.int32) + (start - last.end + last.after)
            return np.stack([t, t, t, np.zeros(n, dtype=np.int32)])
        if grid.first_row == 0:
            t0 = start if last is None else start - last.end + last.after
        else:
            if last is None or last.start != start - grid.first_row or (last.width, last.height) != (grid.width,
                                                                                                   grid.height):
                raise InvalidRequestError(f"{where}.image.first_row={grid.first_row}: this session has no "
                                          f"{grid.width}x{grid.height} image begun at row {start - grid.first_row}")
            t0 = last.t
        k = np.arange(grid.first_row, grid.first_row + n, dtype=np.int32)
        return np.stack([np.full(n, t0, dtype=np.int32), t0 + k // grid.width, t0 + k % grid.width,
                         np.zeros(n, dtype=np.int32)])

    def fed(self, lane: int, start: int, grid: ImageGrid, t: int) -> None:
        """An image's first rows went into ``lane`` at row ``start`` and model position ``t``."""
        if grid.first_row == 0:
            self._images[lane] = (*self._images.get(lane, ()), _Image(start, grid.width, grid.height, t))

    def cut(self, lane: int, keep: int) -> None:
        """``lane`` now holds its first ``keep`` rows (``model_position(lane, keep)`` was not None)."""
        images = self._images.get(lane)
        if images:
            kept = tuple(image for image in images if image.start < keep)
            if kept:
                self._images[lane] = kept
            else:
                del self._images[lane]

    def copy(self, source: int, lane: int) -> None:
        """``lane`` now holds a copy of ``source``'s KV."""
        if self._images.get(source):
            self._images[lane] = self._images[source]
        else:
            self._images.pop(lane, None)

    def forget(self, lane: int) -> None:
        self._images.pop(lane, None)

    def layout(self, lane: int, n_rows: int) -> tuple[tuple[int, int, int], ...] | None:
        """The images ``lane`` holds as (row, width, height) for a KV page of its ``n_rows`` rows; None
        when the last one is not whole (a page would hold part of an image)."""
        images = self._images.get(lane, ())
        if images and images[-1].end > n_rows:
            return None
        return tuple((image.start, image.width, image.height) for image in images)

    def restore(self, lane: int, layout: tuple[tuple[int, int, int], ...], n_rows: int, where: str) -> int:
        """``lane`` holds the images of a KV page of ``n_rows`` rows; returns the model positions those
        rows take. Refuses (naming ``where``) images that overlap, are out of order or pass the rows."""
        images: list[_Image] = []
        row_end = shift = 0
        for i, (row, width, height) in enumerate(layout):
            check_grid(ImageGrid(width, height), width * height, f"{where}[{i}]")
            if row < row_end or row + width * height > n_rows:
                raise InvalidRequestError(f"{where}[{i}] at row {row} ({width}x{height}) overlaps the image before "
                                          f"it or passes the page's {n_rows} rows")
            images.append(_Image(row, width, height, row - shift))
            row_end = row + width * height
            shift += width * height - max(width, height)
        if images:
            self._images[lane] = tuple(images)
        else:
            self._images.pop(lane, None)
        return n_rows - shift
