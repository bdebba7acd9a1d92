"""A batch as the runtime takes it and gives it back: one entry per session, one result per entry,
and the checks every entry passes before any of it reaches llama.cpp, which answers some bad
input (more tokens than ``n_batch``, for one) by aborting the whole process."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from skippy_stage.config import MAX_SESSION_ID_LEN, StageConfig
from skippy_stage.errors import InvalidRequestError
from skippy_stage.model.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from skippy_stage.model.mrope import ImageGrid, check_grid
from skippy_stage.model.sampling import SamplingParams, validated_once


@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class BatchEntry:
    """One session's share of a batch.

    ``token_ids`` are required at stage 0; other stages take ``hidden`` rows (float32,
    ``(n, n_embd)``) and may carry the token ids too, so the final stage's sampler sees
    the history that repetition penalties need. At a head with a projector, ``hidden`` with
    placeholder ``token_ids`` are an image's rows, fed in place of the token embeddings.
    """

    session_id: str
    positions: Sequence[int] | np.ndarray
    token_ids: Sequence[int] | np.ndarray | None = None
    hidden: np.ndarray | None = None
    want_logits: bool = False
    sample: bool = False
    sampling: SamplingParams | None = None
    # A new session that takes this resident prefix's lane, keeping its first positions[0] tokens.
    prefix_id: str | None = None
    # Speculative decoding: cut the session back to positions[0] before this batch (drafts
    # rejected last step); final stage: sample every row in order up to the first that rejects
    # the next row's token (``verify``), and compute every row as an output (``all_rows``, the
    # batch shape llama.cpp's logits_all gives).
    rewind: bool = False
    verify: bool = False
    all_rows: bool = False
    # Final stage: with each sample, its log-probability and this many most likely alternatives,
    # from the full-vocabulary logits before any sampler (None: none).
    top_logprobs: int | None = None
    # A new session that starts as a copy of this live session's first positions[0] tokens (n
    # choices of one prompt: the prompt prefilled once).
    fork_of: str | None = None
    # Final stage: each row's next token's log-probability (the next row's token; for the last row
    # ``next_token``) and this many alternatives: a prompt's logprobs. Every row is an output.
    prompt_logprobs: int | None = None
    next_token: int | None = None
    # Final stage: samples the session's sampler took before this step; a chain built now (after a
    # hand-off, a recovery, a trim) skips as many seeded draws, so it samples what it would have.
    draws_before: int = 0
    # Final stage: with each sample, a digest of the logit row it came from (``logit_digest``): what a
    # recorded schedule holds its replay on the unsplit model to.
    digest_logits: bool = False
    # Final stage, verify: a window sent before the session's previous step came back; sampled only if
    # its first token is the session's last sample at that position, else stale (nothing sampled).
    continues: bool = False
    # An M-RoPE image's rows: the image's grid and this entry's first row in it (``mrope``).
    image: ImageGrid | None = None


# ``EntryResult.draft`` of a final stage that drafts, for a sample it has no draft for.
NO_DRAFT = -1


@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class EntryResult:
    session_id: str
    hidden: np.ndarray | None = None  # inner stages: one row per input token
    logits: np.ndarray | None = None  # final stage: the last token's logits, when asked
    token: int | None = None  # final stage: the sampled next token, when asked
    tokens: tuple[int, ...] | None = None  # final stage, verify: every row's sample up to the first rejection
    logprobs: tuple[TokenLogprob, ...] | None = None  # final stage, top_logprobs: one per sample
    # final stage, prompt_logprobs: one per row with a next token (positions[0] + 1 on)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    logit_digests: tuple[int, ...] | None = None  # final stage, digest_logits: one per sample
    # final stage, native_mtp_enabled: the MTP layers' greedy guess of the token after ``token`` (the last
    # sample), which sits at the position after it; NO_DRAFT where the lane cannot draft now (its MTP state
    # was not kept: a resident prefix taken, a session imported); None where nothing was sampled, or the
    # stage does not draft
    draft: int | None = None


@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class CheckedEntry:
    """An entry that passed ``check_batch``, its positions and tokens as arrays."""

    entry: BatchEntry
    positions: np.ndarray
    tokens: np.ndarray | None

    @property
    def n(self) -> int:
        return int(self.positions.shape[0])


def _check_rows(h: object, n: int, n_embd: int, where: str) -> None:
    if not isinstance(h, np.ndarray) or h.ndim != 2:
        raise InvalidRequestError(f"{where}.hidden must be a 2-D float32 array (rows x n_embd={n_embd})")
    if h.shape[1] != n_embd:
        raise InvalidRequestError(f"{where}.hidden width {h.shape[1]} != n_embd {n_embd}")
    if h.shape[0] != n:
        raise InvalidRequestError(f"{where}.hidden has {h.shape[0]} rows for {n} positions")
    if h.dtype != np.float32:
        raise InvalidRequestError(f"{where}.hidden dtype {h.dtype} is not float32")
    # A sum is finite only if every value is (NaN and inf propagate); an overflowing
    # sum of finite values falls through to the exact check.
    if not math.isfinite(float(h.sum())) and not np.isfinite(h).all():
        row = int(np.nonzero(~np.isfinite(h).all(axis=1))[0][0])
        raise InvalidRequestError(f"{where}.hidden row {row} holds non-finite values (NaN or inf)")


def check_batch(entries: Sequence[BatchEntry], config: StageConfig, *, n_vocab: int, n_embd: int,
                cuttable: bool, mrope: bool = False) -> list[CheckedEntry]:
    """Every entry checked against the stage (``n_vocab``, ``n_embd`` wide hidden rows, ``cuttable``:
    no recurrent layers, ``mrope``: M-RoPE positions, so images on a grid), each refusal an
    InvalidRequestError naming the field. Pure: no llama.cpp, no lane state."""
    cfg = config
    if not entries:
        raise InvalidRequestError("entries is empty: a batch needs at least one entry")
    seen: set[str] = set()
    checked: list[CheckedEntry] = []
    total = 0
    outputs = 0
    for i, e in enumerate(entries):
        where = f"entries[{i}]"
        if not isinstance(e.session_id, str) or not e.session_id or len(e.session_id) > MAX_SESSION_ID_LEN:
            raise InvalidRequestError(f"{where}.session_id={e.session_id!r} must be 1..{MAX_SESSION_ID_LEN} characters")
        if e.session_id in seen:
            raise InvalidRequestError(f"{where}.session_id={e.session_id!r} appears twice in one batch")
        seen.add(e.session_id)
        pos = np.asarray(e.positions)
        if pos.ndim != 1 or pos.shape[0] == 0 or pos.dtype.kind not in "iu":
            raise InvalidRequestError(f"{where}.positions must be a non-empty list of integers, got {pos.shape[0] if pos.ndim == 1 else pos.shape} values")
        n = pos.shape[0]
        total += n
        if total > cfg.n_batch:
            raise InvalidRequestError(f"batch has more than n_batch={cfg.n_batch} tokens ({where} brings the total to {total})")
        # Python ints from here: numpy scalars cost a dispatch per comparison.
        first, last = int(pos[0]), int(pos[-1])
        if first < 0 or last >= 2**31 - 1:
            k, bad = (0, first) if first < 0 else (n - 1, last)
            raise InvalidRequestError(f"{where}.positions[{k}]={bad} is out of range [0, 2^31-1)")
        if n > 1 and last - first != n - 1 or n > 2 and (np.diff(pos) != 1).any():
            k = int(np.nonzero(np.diff(pos) != 1)[0][0])
            raise InvalidRequestError(
                f"{where}.positions are not contiguous: positions[{k}]={int(pos[k])} is followed by {int(pos[k + 1])}"
            )
        tokens = None
        if e.token_ids is not None:
            tokens = np.asarray(e.token_ids)
            if tokens.ndim != 1 or tokens.shape[0] != n or (tokens.size and tokens.dtype.kind not in "iu"):
                raise InvalidRequestError(f"{where}.token_ids has {tokens.shape} values for {n} positions")
            if (not 0 <= int(tokens[0]) < n_vocab if n == 1 else
                    tokens.min() < 0 or tokens.max() >= n_vocab):
                bad = np.nonzero((tokens < 0) | (tokens >= n_vocab))[0]
                k = int(bad[0])
                raise InvalidRequestError(f"{where}.token_ids[{k}]={int(tokens[k])} is out of range [0, {n_vocab})")
        if cfg.include_embeddings:
            if tokens is None:
                raise InvalidRequestError(f"{where}.token_ids are required at stage {cfg.stage_id} (layer_start=0)")
            if e.hidden is not None:
                # The head's own image rows (a projector's), never a client's: the wire has no field for them.
                if cfg.projector_path is None:
                    raise InvalidRequestError(f"{where}.hidden is not accepted at stage {cfg.stage_id} "
                                              f"(layer_start=0, no projector_path)")
                _check_rows(e.hidden, n, n_embd, where)
                if mrope and e.image is None:
                    raise InvalidRequestError(f"{where}.hidden at stage {cfg.stage_id} needs its image grid (image "
                                              f"rows take 2-D positions on this M-RoPE model)")
        else:
            _check_rows(e.hidden, n, n_embd, where)
        if e.image is not None:
            if not mrope:
                raise InvalidRequestError(f"{where}.image: stage {cfg.stage_id}'s model has no M-RoPE positions, so "
                                          f"no image grid")
            check_grid(e.image, n, where)
            if not cuttable:
                raise InvalidRequestError(f"{where}.image: stage {cfg.stage_id} holds a recurrent model, whose state "
                                          f"cannot drop an image fed in part")
            if e.verify or e.rewind:
                raise InvalidRequestError(f"{where}.image with {'verify' if e.verify else 'rewind'}: an image's rows "
                                          f"are prompt, never drafts")
            if cfg.include_embeddings and e.hidden is None:
                raise InvalidRequestError(f"{where}.image at stage {cfg.stage_id} needs the image's rows (the head's "
                                          f"projector's)")
        if e.prefix_id is not None and (not isinstance(e.prefix_id, str) or not e.prefix_id
                                        or len(e.prefix_id) > MAX_SESSION_ID_LEN):
            raise InvalidRequestError(f"{where}.prefix_id={e.prefix_id!r} must be 1..{MAX_SESSION_ID_LEN} characters")
        if e.fork_of is not None:
            if not isinstance(e.fork_of, str) or not e.fork_of or len(e.fork_of) > MAX_SESSION_ID_LEN:
                raise InvalidRequestError(f"{where}.fork_of={e.fork_of!r} must be 1..{MAX_SESSION_ID_LEN} characters")
            if e.prefix_id is not None or e.fork_of == e.session_id:
                raise InvalidRequestError(f"{where}.fork_of={e.fork_of!r} must name another session, and not with "
                                          f"prefix_id")
        if (e.sample or e.want_logits) and not cfg.include_output:
            raise InvalidRequestError(f"{where} asks for logits or a sample, but stage {cfg.stage_id} is not the final stage")
        if e.sample and e.sampling is not None:
            bad = [t for t, _ in validated_once(e.sampling).logit_bias if not 0 <= t < n_vocab]
            if bad:
                raise InvalidRequestError(f"{where}.sampling.logit_bias names token {bad[0]}, outside "
                                          f"[0, {n_vocab})")
        every_row = e.all_rows or e.verify or e.prompt_logprobs is not None
        outputs += n if every_row else int(e.sample or e.want_logits)
        if cfg.include_output and outputs > cfg.n_ubatch:
            # llama.cpp's output buffer grows to the largest batch's outputs x n_vocab floats
            raise InvalidRequestError(f"{where} brings the batch's output rows to {outputs}: at most "
                                      f"n_ubatch={cfg.n_ubatch} per batch (all_rows and verify output every row)")
        if e.rewind and not cuttable:
            raise InvalidRequestError(f"{where}.rewind: stage {cfg.stage_id} holds a recurrent model, whose state "
                                      f"cannot be cut back (no speculative decoding)")
        if e.top_logprobs is not None and (not e.sample or not 0 <= e.top_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"{where}.top_logprobs={e.top_logprobs!r} must be in [0, {MAX_TOP_LOGPROBS}] "
                                      f"and needs sample_last")
        if e.prompt_logprobs is not None:
            if not cfg.include_output or not 0 <= e.prompt_logprobs <= MAX_TOP_LOGPROBS or tokens is None:
                raise InvalidRequestError(f"{where}.prompt_logprobs={e.prompt_logprobs!r} must be in "
                                          f"[0, {MAX_TOP_LOGPROBS}], at the final stage, with the token_ids")
            if e.next_token is not None and not 0 <= e.next_token < n_vocab:
                raise InvalidRequestError(f"{where}.next_token={e.next_token} is out of range [0, {n_vocab})")
        # Each sample adds one token (a verify step samples once per token it keeps), so a session
        # has sampled at most as often as it holds tokens: that bounds the skip a client asks for.
        if not 0 <= e.draws_before <= first:
            raise InvalidRequestError(f"{where}.draws_before={e.draws_before} must be in [0, "
                                      f"positions[0]={first}]: a session samples once per token")
        if e.verify and (not e.sample or tokens is None):
            raise InvalidRequestError(f"{where}.verify needs sample and the token_ids it verifies")
        checked.append(CheckedEntry(e, pos.astype(np.int32), tokens))
    return checked
