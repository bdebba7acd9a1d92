"""How log-probabilities are ranked and placed, as llama-cpp-python does it (no model needed)."""

from __future__ import annotations

import numpy as np

from skippy_stage.model.logprobs import log_softmax, token_logprob
from skippy_stage.server.openai_api.endpoint import _TextOffsets


def test_the_top_alternatives_are_ranked_by_logprob_then_by_the_higher_token_id():
    dist = np.array([-1.0, -0.5, -0.5, -2.0, -0.5], dtype=np.float32)
    got = token_logprob(dist, 1, 2)
    assert got.token == 1 and got.logprob == -0.5
    assert got.top == ((4, -0.5), (2, -0.5))
    assert token_logprob(dist, 3, 0).top == ()


def test_log_softmax_is_llama_cpp_pythons_logits_to_logprobs():
    from llama_cpp import Llama

    logits = np.array([1.0, 2.0, 3.0, -np.inf], dtype=np.float32)
    assert np.allclose(log_softmax(logits), Llama.logits_to_logprobs(logits))


def test_a_token_holding_half_a_character_moves_no_offset_until_the_character_is_whole():
    offsets = _TextOffsets(5)
    euro = "€".encode()
    assert [offsets.next(b"a"), offsets.next(euro[:1]), offsets.next(euro[1:]), offsets.next(b"b")] == [5, 6, 6, 7]
