"""Sampling parameters and llama.cpp sampler chains (one per session, at the final stage).

No sampler is written by hand: the chain is llama.cpp's own (``llama_sampler_*``), in the
order llama.cpp's common code uses: penalties, top-k, top-p, min-p, temperature, then
the seeded distribution — or greedy when the temperature is 0.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import llama_cpp
import numpy as np

from skippy_stage.errors import InvalidRequestError, RuntimeFailure

# llama.cpp's LLAMA_DEFAULT_SEED: "pick a random seed".
RANDOM_SEED = 0xFFFFFFFF
# llama.cpp's GBNF parser and its grammar stacks recurse once per nested group and per rule in a
# chain, with no limit (~60k nested groups overflow the stack and kill the process): bounded here.
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_GRAMMAR_NESTING = 512
# Rules and repetition operators together (each * + ? {m,n} becomes rules of its own), and the
# largest {m,n}: llama.cpp expands a repetition into that many copies.
MAX_GRAMMAR_RULES = 2048
MAX_GRAMMAR_REPEAT = 256
MAX_LOGIT_BIAS = 1024
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = RANDOM_SEED
    # GBNF the sampled tokens must follow (structured output), from position ``grammar_start`` on
    # (the head sets it to the prompt's length); "" for none.
    grammar: str = ""
    grammar_start: int = 0
    # OpenAI's: subtracted once per occurrence / once if present in the last repeat_last_n tokens
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # (token, bias) added to the logits before any other sampler (OpenAI's logit_bias), by token id
    logit_bias: tuple[tuple[int, float], ...] = ()

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
            ("frequency_penalty", self.frequency_penalty,
             math.isfinite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("presence_penalty", self.presence_penalty,
             math.isfinite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("seed", self.seed, 0 <= self.seed <= 0xFFFFFFFF, "in [0, 2^32-1]"),
            ("grammar_start", self.grammar_start, 0 <= self.grammar_start < 2**31, "in [0, 2^31)"),
        )
        for name, value, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"sampling.{name}={value!r} must be {why}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"sampling.logit_bias has {len(self.logit_bias)} tokens, at most {MAX_LOGIT_BIAS}")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidRequestError(f"sampling.logit_bias[{token}]={bias!r} must be in [-100, 100]")
        return self


def check_grammar_text(grammar: str) -> None:
    """Refuse a grammar llama.cpp could not parse without risk: too long, nested too deep (its
    recursive parser has no limit), too many rules, or not UTF-8. Quoted strings, character
    classes and comments are skipped, as the parser does."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"sampling.grammar has {len(grammar)} characters, at most {MAX_GRAMMAR_CHARS}")
    try:
        grammar.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"sampling.grammar is not valid UTF-8 text: {exc.reason} at {exc.start}") from None
    depth = deepest = rules = 0
    i, n = 0, len(grammar)
    while i < n:
        ch = grammar[i]
        if ch in "\"[":
            close = '"' if ch == '"' else "]"
            i += 1
            while i < n and grammar[i] != close:
                i += 2 if grammar[i] == "\\" else 1
        elif ch == "#":
            while i < n and grammar[i] not in "\r\n":
                i += 1
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
        elif grammar.startswith("::=", i) or ch in "*+?":
            rules += 1
        elif ch == "{":
            end = grammar.find("}", i)
            counts = grammar[i + 1 : end if end > 0 else n].split(",")
            if any(c.strip().isdigit() and int(c) > MAX_GRAMMAR_REPEAT for c in counts):
                raise InvalidRequestError(f"sampling.grammar repeats {grammar[i:end + 1][:40]}: at most "
                                          f"{MAX_GRAMMAR_REPEAT} times")
            rules += 1
        i += 1
    if deepest > MAX_GRAMMAR_NESTING:
        raise InvalidRequestError(f"sampling.grammar nests groups {deepest} deep, at most {MAX_GRAMMAR_NESTING}")
    if rules > MAX_GRAMMAR_RULES:
        raise InvalidRequestError(f"sampling.grammar has {rules} rules, at most {MAX_GRAMMAR_RULES}")


def parse_grammar(vocab: llama_cpp.llama_vocab_p, grammar: str) -> llama_cpp.llama_sampler_p:
    """llama.cpp's grammar sampler for ``grammar`` (GBNF, rule ``root``), or InvalidRequestError."""
    check_grammar_text(grammar)
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    if not sampler:
        raise InvalidRequestError("sampling.grammar does not parse: llama.cpp's GBNF parser refused it "
                                  "(it needs a 'root' rule)")
    return sampler


# Settings already checked, by identity (each is kept, so its id cannot be reused meanwhile): a
# session's every step carries the same object (the head builds it once; a stage's codec parses
# each distinct message once). Bounded; a miss checks again.
_CHECKED: dict[int, SamplingParams] = {}
_CHECKED_MAX = 512


def plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits or reads history (no bias, penalties, grammar):
    the pick is the logits' first maximum, and a session's sampler keeps no state between picks."""
    penalised = params.repeat_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
    return (params.greedy and not params.logit_bias and not params.grammar
            and not (penalised and params.repeat_last_n > 0))


def validated_once(params: SamplingParams) -> SamplingParams:
    """``params.validate()``, once per settings object."""
    if _CHECKED.get(id(params)) is not params:
        params.validate()
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[id(params)] = params
    return params


class SamplerChain:
    """A llama.cpp sampler chain that owns its native memory, in llama-cpp-python's order
    (penalties, grammar, then top-k ... and the draw).

    With a grammar, sampling goes through the chain by hand: llama.cpp's grammar *aborts the
    process* when it accepts a token it does not allow (a dead end where every token is masked, an
    EOG before the grammar is complete), so a token is checked against the grammar before it is
    accepted, and a dead end is an error. History tokens (``accept``) feed the penalties only.

    ``argmax``: plain greedy (``plain_greedy``), so the pick is the logits' first maximum and the
    chain keeps no state between picks; the native frame path reads it (by this name) and then
    picks in C as this chain would."""

    def __init__(self, params: SamplingParams, n_vocab: int, vocab: llama_cpp.llama_vocab_p | None = None) -> None:
        self.params = params
        self.n_vocab = n_vocab
        self._penalties = None
        self._grammar = None
        self._dist = None
        self.argmax = False
        chain_params = llama_cpp.llama_sampler_chain_default_params()
        chain_params.no_perf = True
        self._chain = llama_cpp.llama_sampler_chain_init(chain_params)
        add = lambda s: llama_cpp.llama_sampler_chain_add(self._chain, s)  # noqa: E731
        if params.logit_bias:  # first, as llama-cpp-python applies it (a logits processor)
            bad = [t for t, _ in params.logit_bias if not 0 <= t < n_vocab]
            if bad:
                self.close()
                raise InvalidRequestError(f"sampling.logit_bias names token {bad[0]}, outside [0, {n_vocab})")
            biases = (llama_cpp.llama_logit_bias * len(params.logit_bias))(*params.logit_bias)
            add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
        penalised = params.repeat_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
        if penalised and params.repeat_last_n > 0:
            self._penalties = llama_cpp.llama_sampler_init_penalties(n_vocab, params.repeat_last_n,
                                                                     params.repeat_penalty, params.frequency_penalty,
                                                                     params.presence_penalty)
            add(self._penalties)
        if params.grammar:
            if vocab is None:
                raise InvalidRequestError("sampling.grammar needs the stage's vocabulary")
            self._grammar = parse_grammar(vocab, params.grammar)
            add(self._grammar)
            self._cur = np.empty(n_vocab, dtype=_TOKEN_DATA)
            self._ids = np.arange(n_vocab, dtype=np.int32)
            self._one = np.empty(1, dtype=_TOKEN_DATA)
        if params.greedy:
            add(llama_cpp.llama_sampler_init_greedy())
            # Plain greedy keeps no state, so its pick is the logits' first maximum: read in place
            # (~3 us) rather than through llama_sampler_sample, which copies all n_vocab logits
            # into a candidate array first (~120 us a token for a 49k vocabulary).
            self.argmax = plain_greedy(params)
            return
        if params.top_k > 0:
            add(llama_cpp.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
        add(llama_cpp.llama_sampler_init_temp(params.temperature))
        self._dist = llama_cpp.llama_sampler_init_dist(params.seed)  # owned by the chain
        add(self._dist)

    def skip_draws(self, n: int) -> None:
        """Advance the seeded draw past ``n`` samples, as if this chain had taken them: llama.cpp's
        dist sampler draws once per sample whatever the candidates, and its random state cannot be
        exported, so a chain rebuilt for a session (a hand-off, a recovery, a trim) skips the draws
        its predecessor made and samples what it would have (~2 us a draw)."""
        if self._dist is None or n <= 0 or self.params.seed == RANDOM_SEED:
            return  # (an unseeded stream is random either way)
        two = np.zeros(2, dtype=_TOKEN_DATA)
        two["id"] = (0, 1)
        arr = llama_cpp.llama_token_data_array(two.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), 2, -1,
                                               False)
        ref = ctypes.byref(arr)
        for _ in range(n):
            arr.selected = -1
            llama_cpp.llama_sampler_apply(self._dist, ref)

    def accept(self, token: int) -> None:
        """Feed a history token to what looks at history: the repetition penalties."""
        if self._penalties is not None:
            llama_cpp.llama_sampler_accept(self._penalties, token)

    def _allowed(self, token: int) -> bool:
        one = self._one
        one[0] = (token, 0.0, 0.0)
        arr = llama_cpp.llama_token_data_array(one.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), 1, -1,
                                               False)
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        return bool(np.isfinite(one[0]["logit"]))

    def accept_generated(self, token: int) -> None:
        """Replay a token sampled before (a rebuilt chain: after a trim, a hand-off, a recovery) into
        the grammar, refusing one it does not allow rather than letting llama.cpp abort."""
        if self._grammar is None:
            return
        if not self._allowed(token):
            raise InvalidRequestError(f"token {token} of the session's generated text does not follow sampling.grammar")
        llama_cpp.llama_sampler_accept(self._grammar, token)

    def sample(self, ctx: llama_cpp.llama_context_p, output_index: int) -> int | None:
        """Sample from the logits of batch row ``output_index``; the token is accepted too. None:
        the grammar allows no token here (a dead end: the caller ends the session)."""
        if self.argmax:
            ptr = llama_cpp.llama_get_logits_ith(ctx, output_index)
            if not ptr:
                raise RuntimeFailure(f"llama.cpp has no logits for batch row {output_index}")
            logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
            token = int(logits.argmax())
            if logits[token] == logits[token]:  # NaN compares false in llama.cpp's greedy: left to it
                return token
        if self._grammar is None:
            return int(llama_cpp.llama_sampler_sample(self._chain, ctx, output_index))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, output_index), shape=(self.n_vocab,))
        cur = self._cur
        cur["id"] = self._ids
        cur["logit"] = logits
        cur["p"] = 0.0
        arr = llama_cpp.llama_token_data_array(cur.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
                                               self.n_vocab, -1, False)
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(arr))
        selected = int(arr.selected)
        view = np.ctypeslib.as_array(arr.data, shape=(int(arr.size),)).view(_TOKEN_DATA) if arr.size else None
        if view is None or not 0 <= selected < int(arr.size) or not np.isfinite(view[selected]["logit"]):
            return None
        token = int(view[selected]["id"])
        if not self._allowed(token):
            return None
        llama_cpp.llama_sampler_accept(self._chain, token)
        return token

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self) -> None:
        self.close()
