"""Sampling parameters and llama.cpp sampler chains (one per session, at the final stage).

No sampler is written by hand: the chain is llama.cpp's own (``llama_sampler_*``), in the
order llama.cpp's common code uses: penalties, top-k, top-p, min-p, temperature, then
the seeded distribution — or greedy when the temperature is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import llama_cpp

from skippy_stage.errors import InvalidRequestError

# llama.cpp's LLAMA_DEFAULT_SEED: "pick a random seed".
RANDOM_SEED = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = RANDOM_SEED

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> SamplingParams:
        """Refuse values llama.cpp would misbehave on, naming the field."""
        checks = (
            ("temperature", self.temperature, math.isfinite(self.temperature) and self.temperature >= 0.0, ">= 0"),
            ("top_k", self.top_k, self.top_k >= 0, ">= 0"),
            ("top_p", self.top_p, 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", self.min_p, 0.0 <= self.min_p < 1.0, "in [0, 1)"),
            ("repeat_penalty", self.repeat_penalty,
             math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0.0, "> 0"),
            ("repeat_last_n", self.repeat_last_n, 0 <= self.repeat_last_n <= 4096, "in [0, 4096]"),
            ("seed", self.seed, 0 <= self.seed <= 0xFFFFFFFF, "in [0, 2^32-1]"),
        )
        for name, value, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"sampling.{name}={value!r} must be {why}")
        return self


class SamplerChain:
    """A llama.cpp sampler chain that owns its native memory."""

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        self.params = params
        chain_params = llama_cpp.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        self._chain = llama_cpp.llama_sampler_chain_init(chain_params)
        add = lambda s: llama_cpp.llama_sampler_chain_add(self._chain, s)  # noqa: E731
        if params.repeat_penalty != 1.0 and params.repeat_last_n > 0:
            add(llama_cpp.llama_sampler_init_penalties(n_vocab, params.repeat_last_n, params.repeat_penalty, 0.0, 0.0))
        if params.greedy:
            add(llama_cpp.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            add(llama_cpp.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
        add(llama_cpp.llama_sampler_init_temp(params.temperature))
        add(llama_cpp.llama_sampler_init_dist(params.seed))

    def accept(self, token: int) -> None:
        """Feed a token into the chain's history (what repetition penalties look at)."""
        llama_cpp.llama_sampler_accept(self._chain, token)

    def sample(self, ctx: llama_cpp.llama_context_p, output_index: int) -> int:
        """Sample from the logits of batch row ``output_index``; the token is accepted too."""
        return int(llama_cpp.llama_sampler_sample(self._chain, ctx, output_index))

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self) -> None:
        self.close()
