"""llama-server's /tokenize, /detokenize and /props at the head, in llama-server's shapes.

Against a real ``serve`` process (SmolLM2 whole, one stage: only the head's tokenizer is under
test). The contract: /tokenize gives the ids llama-cpp-python's tokenizer gives on the same model,
/detokenize gives the text back (control tokens as their text, as llama-server renders them), an
id outside the vocabulary is refused naming it, and /props reports the context one session holds
and the GGUF's own chat template.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import llama_cpp
import pytest

from skippy_stage.cli.local import free_ports

CTX_SIZE, LANES = 4096, 2
TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "naïve café, Straße, 東京タワー, emoji 🚀🎉 and Ünïcödé",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "  leading spaces\n\ttabs and trailing   ",
    "",
]


@pytest.fixture(scope="module")
def vocab(smollm2):
    """llama-cpp-python's tokenizer of the same GGUF."""
    llm = llama_cpp.Llama(model_path=str(smollm2), vocab_only=True, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def api(smollm2, start_pipeline):
    port = free_ports("127.0.0.1", 1)[0]
    pipeline = start_pipeline(smollm2, [(0, 30)], http_port=[port], ctx_size=CTX_SIZE, lane_count=LANES,
                              kv_unified=False)
    yield f"http://127.0.0.1:{port}"
    pipeline.stop()


def call(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_tokenize_gives_llama_cpp_pythons_ids_and_detokenize_gives_the_text_back(api, vocab):
    for text in TEXTS:
        for add_special in (False, True):
            status, answer = call(f"{api}/tokenize", {"content": text, "add_special": add_special})
            assert status == 200 and set(answer) == {"tokens"}
            assert answer["tokens"] == vocab.tokenize(text.encode(), add_bos=add_special, special=True), text
        tokens = call(f"{api}/tokenize", {"content": text})[1]["tokens"]
        status, answer = call(f"{api}/detokenize", {"tokens": tokens})
        assert status == 200 and answer == {"content": text}
        assert answer["content"] == vocab.detokenize(tokens, special=True).decode()
    # special tokens: one id each, or their characters as plain text with parse_special false
    special = call(f"{api}/tokenize", {"content": TEXTS[3]})[1]["tokens"]
    plain = call(f"{api}/tokenize", {"content": TEXTS[3], "parse_special": False})[1]["tokens"]
    assert len(plain) > len(special)
    assert plain == vocab.tokenize(TEXTS[3].encode(), add_bos=False, special=False)


def test_with_pieces_each_id_comes_with_its_text_or_its_bytes(api):
    for text in TEXTS:
        status, answer = call(f"{api}/tokenize", {"content": text, "with_pieces": True})
        assert status == 200
        assert [t["id"] for t in answer["tokens"]] == call(f"{api}/tokenize", {"content": text})[1]["tokens"]
        assert all(set(t) == {"id", "piece"} for t in answer["tokens"])
        pieces = [t["piece"] for t in answer["tokens"]]
        assert b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in pieces) == text.encode()
    # SmolLM2 spells 🚀 in three tokens, none a whole character: their pieces come as bytes
    rocket = call(f"{api}/tokenize", {"content": "🚀", "with_pieces": True})[1]["tokens"]
    assert [t["piece"] for t in rocket] == [[0xF0, 0x9F], [0x9A], [0x80]]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("detokenize", {"tokens": [1, 49152]}, "tokens", ["tokens[1]=49152", "vocabulary"]),
        ("detokenize", {"tokens": [-1]}, "tokens", ["tokens[0]=-1"]),
        ("detokenize", {"tokens": [1, "two"]}, "tokens", ["tokens[1]"]),
        ("detokenize", {"tokens": [True]}, "tokens", ["tokens[0]"]),
        ("detokenize", {"tokens": "1 2"}, "tokens", ["tokens"]),
        ("tokenize", {}, "content", ["content"]),
        ("tokenize", {"content": [1, 2]}, "content", ["content"]),
        ("tokenize", {"content": "hi", "with_pieces": "yes"}, "with_pieces", ["with_pieces"]),
        ("tokenize", {"content": "hi", "add_special": 1}, "add_special", ["add_special"]),
    ],
)
def test_bad_input_gets_400_naming_the_field_and_value(api, path, body, param, words):
    status, answer = call(f"{api}/{path}", body)
    assert status == 400
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param
    for word in words:
        assert word in answer["error"]["message"]


def test_props_report_the_model_its_session_context_and_chat_template(api, vocab, smollm2):
    status, props = call(f"{api}/props")
    assert status == 200
    assert props["model_path"] == str(smollm2) and props["model"] == smollm2.name
    assert props["n_ctx"] == props["default_generation_settings"]["n_ctx"] == CTX_SIZE // LANES
    assert props["n_ctx_train"] == int(vocab.metadata["llama.context_length"])
    assert props["n_vocab"] == vocab.n_vocab()
    assert props["total_slots"] == LANES
    assert props["chat_template"] == vocab.metadata["tokenizer.chat_template"] and "im_start" in props["chat_template"]
    assert props["eos_token"] == vocab.detokenize([vocab.token_eos()], special=True).decode() == "<|im_end|>"
    assert props["modalities"] == {"vision": False, "audio": False}
    for endpoint in ("POST /v1/chat/completions", "POST /v1/messages", "POST /tokenize", "POST /detokenize",
                     "GET /props"):
        assert endpoint in props["endpoints"]
