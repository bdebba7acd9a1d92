"""Defaults that serve a real prompt: ``skippy-stage up`` with no sizing flags.

A new user's first long prompt must not meet a limit the unsplit model does not have. With
the defaults (context from the model, one KV pool shared by the lanes) a 1,500-token prompt
through three stages gives exactly what ``Llama(n_ctx=2048)`` gives for the unsplit model,
and a prompt longer than the context is refused naming the setting that raises the limit.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

import pytest

from skippy_stage.cli.client import generate
from skippy_stage.errors import SkippyError
from skippy_stage.model.loader import reference_llama

MAX_TOKENS = 24
PARAGRAPH = ("The history of the lighthouse begins with fires lit on hilltops to guide ships home. Over centuries, "
             "towers of stone replaced the fires, and lenses replaced the open flame; keepers trimmed wicks, wound "
             "clockwork and logged every passing sail. ")


def long_prompt(llm, n_tokens: int) -> str:
    text = PARAGRAPH
    while len(llm.tokenize(text.encode())) < n_tokens:
        text += PARAGRAPH
    return text + "In one sentence, the lighthouse keeper's job was to"


@pytest.fixture(scope="module")
def up(smollm2, slice_cache):
    """``skippy-stage up --model M --stages 3`` and nothing else (its slice cache shared with the run)."""
    env = {**os.environ, "SKIPPY_STAGE_CACHE": str(slice_cache)}
    proc = subprocess.Popen([sys.executable, "-m", "skippy_stage", "--log-level", "warning", "up", "--model",
                             str(smollm2), "--stages", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint, f"up exited with {proc.wait()} before printing the head endpoint"
        yield endpoint
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_1500_token_prompt_through_up_with_default_flags_gives_exactly_the_reference_text(smollm2, up):
    llm = reference_llama(smollm2, n_ctx=2048, verbose=False)
    try:
        prompt = long_prompt(llm, 1500)
        n_prompt = len(llm.tokenize(prompt.encode()))
        expected = llm.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()
    assert 1500 <= n_prompt < 2048 - MAX_TOKENS

    out = io.StringIO()
    figures = generate(up, prompt, max_tokens=MAX_TOKENS, temperature=0.0, seed=None, chat=False, out=out)

    assert figures["completion_tokens"] == MAX_TOKENS
    assert out.getvalue() == expected


def test_a_prompt_longer_than_the_context_is_refused_naming_the_setting(smollm2, up):
    llm = reference_llama(smollm2, n_ctx=256, verbose=False)
    try:
        prompt = long_prompt(llm, 8300)  # SmolLM2 was trained on 8192
    finally:
        llm.close()

    with pytest.raises(SkippyError) as info:
        generate(up, prompt, max_tokens=8, temperature=0.0, seed=None, chat=False, out=io.StringIO())

    message = str(info.value)
    assert "INVALID_ARGUMENT" in message and "a session holds at most 8192" in message
    assert "raise ctx_size" in message
