"""The head's view of the resident prefixes: which finished session's KV a new one may take.

When a session ends, every stage may keep its lane's KV as a *resident prefix* under the
session's id (``cache_idle_slots`` bounds how many). The head remembers the tokens each one
holds and, for a new request, picks the one sharing the longest common prefix with its
prompt, the rule llama-cpp-python's ``Llama`` applies to its single KV cache — so a chat's
next turn prefills exactly the tokens ``Llama`` would, in the same batches, and the texts
agree. Block hashes (vLLM, SGLang) share prefixes across many sequences at block granularity;
with a handful of whole-lane prefixes and an exact reference, the longest common prefix is
both simpler and the one that matches.

A prefix holds its tokens only while the stages keep it; a stage that evicted or lost it
answers so, and the head prefills from scratch: a miss costs time, never text.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Match:
    prefix_id: str
    reuse: int  # tokens of the prefix the new session keeps; its prefill starts here


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """How many cached tokens a prompt may keep: the longest common prefix, less one when it is
    the whole prompt (the last prompt token must be decoded again for its logits)."""
    n = common_prefix(cached, prompt)
    return n - 1 if n == len(prompt) else n


class PrefixCache:
    """Resident prefixes by id, least recently used first, at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._tokens: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)

    def claim(self, prompt: Sequence[int], fit: Callable[[int], int] | None = None) -> Match | None:
        """Take the prefix that saves the most prefill for ``prompt`` (it leaves the cache: one
        session at a time owns a lane), or None when none shares a token. ``fit``: the most of a
        shared run of ``n`` tokens the prompt may keep (a cut never inside an M-RoPE image)."""
        with self._lock:
            best: Match | None = None
            for prefix_id, tokens in self._tokens.items():
                n = reusable(tokens, prompt)
                n = n if fit is None or n <= 0 else fit(n)
                if n > 0 and (best is None or n > best.reuse):
                    best = Match(prefix_id, n)
            if best is not None:
                del self._tokens[best.prefix_id]
            return best

    def add(self, prefix_id: str, tokens: Sequence[int]) -> list[str]:
        """Remember a retired session's tokens; returns the prefixes evicted to make room (the
        caller drops them on the stages, so every stage frees the same lanes)."""
        if self.capacity <= 0 or not tokens:
            return [prefix_id]
        with self._lock:
            self._tokens[prefix_id] = tuple(tokens)
            self._tokens.move_to_end(prefix_id)
            evicted = []
            while len(self._tokens) > self.capacity:
                oldest, _ = self._tokens.popitem(last=False)
                evicted.append(oldest)
            return evicted

    def forget(self, prefix_id: str) -> None:
        with self._lock:
            self._tokens.pop(prefix_id, None)

    def snapshot(self) -> list[tuple[str, int]]:
        with self._lock:
            return [(p, len(t)) for p, t in self._tokens.items()]
