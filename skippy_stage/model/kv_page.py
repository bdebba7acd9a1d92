"""A session's KV as a page: what one stage exports and another stage of the same layers imports
(a session moved to a stand-in, a resident prefix handed over)."""

from __future__ import annotations

from dataclasses import dataclass

KV_PAGE_VERSION = 1


@dataclass(frozen=True)
class KvPageDesc:
    """What a KV page was cut from: an import checks each field against the importing stage."""

    version: int
    model_digest: str  # sha256 of the stage file
    layer_start: int
    layer_end: int
    n_tokens: int
    cache_type_k: str
    cache_type_v: str
    n_ctx: int  # cells of the context it came from (informational: the lane must hold n_tokens)
    batches: int = 0  # batches that fed the session (the importer's count goes on from it)


@dataclass(frozen=True)
class KvPage:
    """One session's KV for this stage's layers (``llama_state_seq_get_data``), and the tokens
    it holds (the final stage's sampler needs them for repetition penalties)."""

    descriptor: KvPageDesc
    data: bytes
    token_ids: tuple[int, ...] = ()
    # The M-RoPE images it holds: (the row each starts at, its grid's width, height), in order (``mrope``).
    images: tuple[tuple[int, int, int], ...] = ()
