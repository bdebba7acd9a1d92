"""Defaults that serve a real prompt: ``skippy-stage up`` with no flags but the HTTP port, started
the way a user starts it (the console script, from a directory of their own).

A new user's first long prompt must not meet a limit the unsplit model does not have, a chat's
next turn must reuse the previous one's KV, and no text may depend on how many other clients
there are. With the defaults (separate lanes, each holding the model's training context, with
resident prefixes) a 1,500-token prompt through three stages gives exactly what
``Llama(n_ctx=2048)`` gives for the unsplit model, a 4-turn chat reuses every turn and equals one
``Llama`` fed the same turns, 32 concurrent greedy clients all get the unsplit model's text, and a
prompt longer than the context is refused naming the setting that raises the limit.

``up`` runs in a directory holding a ``skippy_stage/`` that fails on import: the stages it starts
must import the installed package (with its compiled parts), never the current directory.
"""

from __future__ import annotations

import io
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from support.chat import TURNS, chat, reference_chat
from support.up import SCRIPT, running_up

from skippy_stage.cli.client import generate
from skippy_stage.cli.local import free_ports
from skippy_stage.errors import SkippyError
from skippy_stage.model.loader import reference_llama

MAX_TOKENS = 24
PARAGRAPH = ("The history of the lighthouse begins with fires lit on hilltops to guide ships home. Over centuries, "
             "towers of stone replaced the fires, and lenses replaced the open flame; keepers trimmed wicks, wound "
             "clockwork and logged every passing sail. ")
# Eight prompts no other test uses, each sent by four clients at once.
PROMPTS = ["A recipe for pancakes starts with", "The three primary colours are", "Dear hiring manager, I am writing",
           "In 1969 the first people to walk on the Moon", "def fibonacci(n):", "The rain in Spain",
           "Photosynthesis is the process by which", "Once upon a time, in a village by the sea,"]
CONCURRENT_TOKENS = 16
DECOY = 'raise ImportError("a decoy skippy_stage/ in the working directory was imported")\n'


def long_prompt(llm, n_tokens: int) -> str:
    text = PARAGRAPH
    while len(llm.tokenize(text.encode())) < n_tokens:
        text += PARAGRAPH
    return text + "In one sentence, the lighthouse keeper's job was to"


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """A working directory with a ``skippy_stage/`` package that fails on import."""
    here = tmp_path_factory.mktemp("user")
    (here / "skippy_stage").mkdir()
    (here / "skippy_stage" / "__init__.py").write_text(DECOY)
    return here


@pytest.fixture(scope="module")
def up(smollm2, slice_cache, user_dir):
    """``skippy-stage up --model M --stages 3 --http-port P`` and nothing else (its slice cache
    shared with the run), from ``user_dir``; yields (endpoint, http port, its stderr file)."""
    http = free_ports("127.0.0.1", 1)[0]
    log = user_dir / "up.log"
    with running_up("--model", str(smollm2), "--stages", "3", "--http-port", str(http), cache=slice_cache,
                    cwd=user_dir, log=log) as (endpoint, _):
        yield endpoint, http, log


def test_up_beside_a_decoy_package_runs_the_installed_one_and_says_its_native_paths_are_loaded(up, user_dir):
    _, _, log = up
    first = log.read_text().splitlines()[0]
    assert first.startswith("# native capture and frame path loaded"), first
    assert "decoy" not in log.read_text()

    info = subprocess.run([str(SCRIPT), "info"], capture_output=True, text=True, cwd=user_dir, timeout=120)
    assert info.returncode == 0, info.stderr
    assert "native            native capture and frame path loaded" in info.stdout


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
    figures = generate(up[0], prompt, max_tokens=MAX_TOKENS, temperature=0.0, seed=None, chat=False, out=out)

    assert figures["completion_tokens"] == MAX_TOKENS
    assert out.getvalue() == expected


def test_a_prompt_longer_than_the_context_is_refused_naming_the_setting(smollm2, up):
    llm = reference_llama(smollm2, n_ctx=256, verbose=False)
    try:
        prompt = long_prompt(llm, 8300)  # SmolLM2 was trained on 8192
    finally:
        llm.close()

    with pytest.raises(SkippyError) as info:
        generate(up[0], prompt, max_tokens=8, temperature=0.0, seed=None, chat=False, out=io.StringIO())

    message = str(info.value)
    assert "INVALID_ARGUMENT" in message and "a session holds at most 8192" in message
    assert "raise ctx_size" in message


def test_a_four_turn_chat_with_default_flags_reuses_every_turn_and_equals_one_llama(smollm2, up):
    _, http, _ = up
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=120)

    answers, cached = chat(client, smollm2.name, TURNS)

    print("cached tokens per turn:", cached)
    assert answers == reference_chat(smollm2, TURNS)
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])


def test_32_concurrent_greedy_clients_with_default_flags_all_get_the_unsplit_models_text(smollm2, up):
    _, http, _ = up
    llm = reference_llama(smollm2, n_ctx=2048, verbose=False)
    try:
        expected = {p: llm.create_completion(p, max_tokens=CONCURRENT_TOKENS, temperature=0)["choices"][0]["text"]
                    for p in PROMPTS}
    finally:
        llm.close()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=300)

    def one(prompt: str) -> str:
        return client.completions.create(model=smollm2.name, prompt=prompt, max_tokens=CONCURRENT_TOKENS,
                                         temperature=0).choices[0].text

    started = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        prompts = PROMPTS * 4
        texts = list(pool.map(one, prompts))
    exact = sum(text == expected[p] for p, text in zip(prompts, texts))
    print(f"32 concurrent clients: {exact}/32 exact in {time.perf_counter() - started:.1f}s")
    assert exact == 32, [(p, t, expected[p]) for p, t in zip(prompts, texts) if t != expected[p]]
