"""Test helpers: the package's in-process chain, and its configs under the name the tests use."""

from __future__ import annotations

from skippy_stage.model.chain import Chain, Step, chain_configs

__all__ = ["Chain", "Step", "split_configs"]

# StageConfigs for consecutive layer ranges, chained upstream to downstream.
split_configs = chain_configs
