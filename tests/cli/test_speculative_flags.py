"""``--draft-k K`` and the API's ``k`` mean what llama-cpp-python means by
``LlamaPromptLookupDecoding(num_pred_tokens=K)``, to the last token.

A pipeline started the way a user starts it (``skippy-stage up --speculative ngram --draft-k 4``,
nothing else) is asked through ``skippy-stage generate --speculative ngram --draft-k K`` and through
the OpenAI API with no other speculative setting, and every text must equal
``Llama(draft_model=LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=K))``'s, loaded as
the stages load. The prompts end mid-draft, as the reference's record of its own drafts shows:
two where ``max_tokens`` falls on a kept draft with more drafted rows after it, one where the
end-of-generation token does. Adaptive drafting changes the batches' shapes and is asked for by
name (``--draft-k auto``); it is checked here only to be accepted.
"""

from __future__ import annotations

import argparse
import subprocess
from dataclasses import dataclass

import openai
import pytest
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
from support.up import SCRIPT, running_up

from skippy_stage.cli.client import add_speculative_flags, speculative_flags
from skippy_stage.cli.local import free_ports
from skippy_stage.config import AUTO_DRAFT_K, SpeculativeConfig
from skippy_stage.model.loader import reference_llama

HEAD_K = 4  # up's --draft-k: what an API request with no speculative setting of its own gets
KS = (2, 4, 8)
# Answers cut by max_tokens at the last kept draft, at most CUT_TOKENS in, with more drafted rows
# after it: a list the answer copies (long runs of drafts, most of them kept), and a text that
# drafts now and then, where adaptive drafting's other batch shapes turned the greedy text
# elsewhere (in llama-cpp-python with the head's adaptive schedule as its draft model, k 2, 4, 8).
COPY = ("Shopping list:\n1. apples\n2. bread\n3. milk\n4. eggs\n5. butter\n6. cheese\n7. rice\n8. tea\n\n"
        "The same shopping list again:\n1.")
FOX = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown"
CUT_TOKENS = 48
# A chat turn asked again: the answer is drafted from the first one, its end-of-generation token too.
ASKED_AGAIN = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"
               "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@dataclass(frozen=True)
class Expected:
    prompt: str
    max_tokens: int
    text: str


class _Recorded(LlamaPromptLookupDecoding):
    """The reference's own drafter, remembering each call: (tokens so far, the drafts)."""

    def __init__(self, k: int) -> None:
        super().__init__(max_ngram_size=2, num_pred_tokens=k)
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, input_ids, **kwargs):
        drafts = super().__call__(input_ids, **kwargs)
        self.calls.append((len(input_ids), [int(t) for t in drafts]))
        return drafts


def _kept_mid_draft(calls: list[tuple[int, list[int]]], n_prompt: int, sampled: list[int]) -> list[int]:
    """Indices of sampled tokens that were drafts a batch kept, with more drafted rows after them."""
    found = []
    for n_seen, drafts in calls:
        first = n_seen - n_prompt  # the index of the token drafts[0] proposes
        for i, draft in enumerate(drafts[:-1]):
            if first + i >= len(sampled) or sampled[first + i] != draft:
                break
            found.append(first + i)
    return found


def _reference_run(llm, drafter: _Recorded, prompt: str, max_tokens: int) -> tuple[str, list[int], list[int]]:
    """create_completion's text, every token it sampled (an ending one included) and the indices
    of those that were kept drafts with more drafted rows after them."""
    sampled: list[int] = []
    sample = llm.sample

    def recording(*args, **kwargs):
        token = sample(*args, **kwargs)
        sampled.append(int(token))
        return token

    drafter.calls.clear()
    llm.sample = recording  # the reference instance only records what it samples
    try:
        text = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0)["choices"][0]["text"]
    finally:
        del llm.sample
    n_prompt = len(llm.tokenize(prompt.encode(), special=True))
    return text, sampled, _kept_mid_draft(drafter.calls, n_prompt, sampled)


@pytest.fixture(scope="module")
def expected(smollm2) -> dict[int, list[Expected]]:
    """For each k: the prompts cut mid-draft by max_tokens, and the chat turn whose
    end-of-generation token is a kept draft, with the reference's texts."""
    out: dict[int, list[Expected]] = {}
    for k in KS:
        drafter = _Recorded(k)
        llm = reference_llama(smollm2, n_ctx=2048, verbose=False, draft_model=drafter)
        try:
            eog = llm.token_eos()
            out[k] = []
            for prompt in (COPY, FOX):
                _, sampled, kept = _reference_run(llm, drafter, prompt, CUT_TOKENS)
                assert eog not in sampled and kept, (k, sampled, kept)
                cut = max(kept) + 1
                text, sampled, kept = _reference_run(llm, drafter, prompt, cut)
                assert len(sampled) == cut and cut - 1 in kept, "max_tokens falls inside a kept draft, rows after it"
                out[k].append(Expected(prompt, cut, text))
            text, sampled, kept = _reference_run(llm, drafter, ASKED_AGAIN, 32)
            assert sampled[-1] == eog and len(sampled) - 1 in kept, "the end-of-generation token is a kept draft"
            out[k].append(Expected(ASKED_AGAIN, 32, text))
        finally:
            llm.close()
    return out


@pytest.fixture(scope="module")
def up(smollm2, slice_cache, tmp_path_factory):
    """``skippy-stage up --model M --stages 3 --http-port P --speculative ngram --draft-k 4``;
    yields (head endpoint, http port)."""
    here = tmp_path_factory.mktemp("user")
    http = free_ports("127.0.0.1", 1)[0]
    with running_up("--model", str(smollm2), "--stages", "3", "--http-port", str(http), "--speculative", "ngram",
                    "--draft-k", str(HEAD_K), cache=slice_cache, cwd=here, log=here / "up.log") as (endpoint, _):
        yield endpoint, http


@pytest.mark.parametrize("k", KS)
def test_generate_with_draft_k_gives_the_references_text_to_the_last_token(up, expected, k):
    endpoint, _ = up
    for case in expected[k]:
        run = subprocess.run([str(SCRIPT), "--log-level", "warning", "generate", "--endpoint", endpoint,
                              "--speculative", "ngram", "--draft-k", str(k), "--max-tokens", str(case.max_tokens),
                              case.prompt], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert run.stdout == case.text, (k, case.max_tokens)


def test_the_openai_api_with_the_heads_draft_k_or_its_own_gives_the_references_text(up, expected):
    _, http = up
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=120)
    for k in KS:
        # no speculative setting: the head's --draft-k; otherwise the request's k alone
        extra = {} if k == HEAD_K else {"extra_body": {"speculative": {"k": k}}}
        for case in expected[k]:
            result = client.completions.create(model="m", prompt=case.prompt, max_tokens=case.max_tokens,
                                               temperature=0, **extra)
            assert result.choices[0].text == case.text, (k, case.max_tokens)
    adaptive = client.completions.create(model="m", prompt=COPY, max_tokens=8, temperature=0,
                                         extra_body={"speculative": {"k": "auto"}})
    assert adaptive.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="m", prompt=COPY, max_tokens=8, extra_body={"speculative": {"k": "many"}})
    assert "speculative.k" in str(refused.value)


def test_a_number_k_is_fixed_drafting_and_adaptive_drafting_is_asked_for_by_name():
    assert SpeculativeConfig(drafter="ngram").adaptive is False, "the default: the reference's drafting"
    auto = SpeculativeConfig(drafter="ngram", k="auto")
    assert (auto.k, auto.adaptive, auto.problem()) == (AUTO_DRAFT_K, True, None)
    # a request's own number is fixed drafting, even over an adaptive head; "auto" over a fixed one adapts
    assert auto.override(k=4) == SpeculativeConfig(drafter="ngram", k=4)
    assert auto.override(drafter="ngram") == auto
    assert SpeculativeConfig(drafter="ngram", k=4).override(k="auto") == auto
    # the long form of older configs keeps its meaning: adaptive up to k
    assert SpeculativeConfig(drafter="ngram", k=6, adaptive=True).override(ngram=3).adaptive is True
    assert "or 'auto'" in SpeculativeConfig(drafter="ngram", k="often").problem()

    parser = argparse.ArgumentParser()
    add_speculative_flags(parser, model=False)
    assert speculative_flags(parser.parse_args(["--speculative", "ngram", "--draft-k", "4"])) == \
        {"drafter": "ngram", "k": 4, "adaptive": False}
    assert speculative_flags(parser.parse_args(["--draft-k", "auto"])) == {"k": "auto"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--draft-k", "many"])
