"""Test helpers: the package's in-process chain, with configs that keep slices in the test cache."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from skippy_stage.config import StageConfig
from skippy_stage.model.chain import Chain, Step, chain_configs

__all__ = ["Chain", "Step", "split_configs"]


def split_configs(model: Path, ranges: Sequence[tuple[int, int]], cache_dir: Path, **overrides: object) -> list[StageConfig]:
    """StageConfigs for consecutive layer ranges, chained upstream to downstream."""
    return chain_configs(model, ranges, cache_dir, **overrides)
