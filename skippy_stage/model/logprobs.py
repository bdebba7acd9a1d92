"""Log-probabilities of sampled tokens: the type a final stage returns with each sample, and the
arithmetic that makes them match llama-cpp-python's (pure numpy, no llama.cpp)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (log-softmax of the row's raw logits, as
    llama-cpp-python's ``logits_to_logprobs``), and the most likely tokens with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """llama-cpp-python's ``Llama.logits_to_logprobs`` for one row (float32, the same steps)."""
    top = np.amax(logits)
    if not np.isfinite(top):
        top = 0.0
    shifted = np.subtract(logits, top, dtype=np.single)
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted)))


def token_logprob(dist: np.ndarray, token: int, n: int) -> TokenLogprob:
    """``token``'s log-probability in ``dist`` (a row's ``log_softmax``), with the ``n`` most likely
    tokens as llama-cpp-python lists them."""
    top: tuple[tuple[int, float], ...] = ()
    if n:
        # llama-cpp-python's order: by log-probability, then the higher token id first on a tie
        threshold = dist[np.argpartition(dist, -n)[-n]]
        ids = np.nonzero(dist >= threshold)[0]
        best = ids[np.lexsort((-ids, -dist[ids]))][:n]
        top = tuple((int(t), float(dist[t])) for t in best)
    return TokenLogprob(int(token), float(dist[token]), top)
