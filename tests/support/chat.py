"""A multi-turn chat through the OpenAI API and the same turns fed to one ``Llama``: the reference
keeps the KV of its previous prompt and reuses the longest common prefix, which is the rule the
head applies, so the suffix prefills have the same shapes and the texts must be equal."""

from __future__ import annotations

from pathlib import Path

import openai

from skippy_stage.model.loader import reference_llama

MAX_TOKENS = 24
TURNS = ["What is the capital of France?", "And the capital of Italy?", "Which of the two cities is older?",
         "Answer that again in one word."]


def reference_chat(model: Path, turns: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    llm = reference_llama(model, n_ctx=2048, verbose=False)
    try:
        messages, answers = [], []
        for question in turns:
            messages.append({"role": "user", "content": question})
            answer = llm.create_chat_completion(messages, temperature=0, max_tokens=max_tokens)
            answers.append(answer["choices"][0]["message"]["content"])
            messages.append({"role": "assistant", "content": answers[-1]})
        return answers
    finally:
        llm.close()


def chat(client: openai.OpenAI, model_name: str, turns: list[str],
         max_tokens: int = MAX_TOKENS) -> tuple[list[str], list[int]]:
    """Each turn's answer and its ``usage.prompt_tokens_details.cached_tokens``."""
    messages, answers, cached = [], [], []
    for question in turns:
        messages.append({"role": "user", "content": question})
        result = client.chat.completions.create(model=model_name, messages=messages, temperature=0,
                                                max_tokens=max_tokens)
        answers.append(result.choices[0].message.content)
        cached.append(result.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers, cached
