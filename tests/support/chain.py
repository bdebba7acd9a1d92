"""Test helpers: the package's in-process chain, and its configs under the name the tests use."""

from __future__ import annotations

from skippy_stage.model.chain import Chain, Step, chain_configs

__all__ = ["EQUIVALENCE_PROMPTS", "Chain", "Step", "split_configs"]

# The equivalence tests' prompts (tests/model/test_equivalence.py), shared with every test that
# holds a pipeline to the unsplit model "on all prompts of the equivalence tests".
EQUIVALENCE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]

# StageConfigs for consecutive layer ranges, chained upstream to downstream.
split_configs = chain_configs
