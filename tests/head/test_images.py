"""Images at the head: a split reads an image exactly as the unsplit model does.

The reference is llama-cpp-python's own multimodal path in one process
(``model.multimodal_reference``): ``MTMDChatHandler``'s libmtmd context on a ``Llama`` loaded as
the stages load, evaluating a prompt the way its ``__call__`` does (text chunks through
``Llama.eval``, each image through ``mtmd_helper_eval_chunk_single``), then greedy tokens one
``eval`` at a time. The split is a
chain of stage runtimes whose head has the same projector (``projector_path``): it encodes the
image with libmtmd, feeds the rows to its own layers in place of token embeddings, and the
stages below see hidden states as for any prompt. No vision model ships on PyPI, so the
projector is ``make-projector``'s random-weight one for SmolLM2; random weights make an image
that is read differently show at once.

Then the whole path through real processes: the OpenAI API's ``image_url`` parts, gRPC
``Generate``'s ``media``, a prefix with an image kept and reused, and the refusals.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
from support.chain import Chain, Step, split_configs
from support.images import data_url, png

from skippy_stage.cli.local import free_ports
from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError, InvalidFieldError
from skippy_stage.model import gguf_file
from skippy_stage.model.multimodal_reference import MultimodalReference
from skippy_stage.model.projector import PLACEHOLDER_TOKEN, check_image, image_size
from skippy_stage.model.projector_fixture import write_projector
from skippy_stage.model.runtime import StageRuntime
from skippy_stage.v1 import stage_pb2, stage_pb2_grpc

N_TOKENS = 8
# One llama.cpp setting the reference cannot take as "auto": flash attention off on both sides
# (llama.cpp's AUTO and Llama's default differ, and move a logit by up to 0.93).
SETTINGS = {"flash_attn_type": "disabled", "n_threads": 2}
SPLITS = {"0:10/10:30": [(0, 10), (10, 30)], "0:1/1:20/20:30": [(0, 1), (1, 20), (20, 30)]}
PROMPTS = [
    "<|im_start|>user\nWhat is in this picture? <__media__> Describe it.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n<__media__>\nName the colours you see."
    "<|im_end|>\n<|im_start|>assistant\n",
]
IMAGES = {"80x48": png(80, 48, seed=1), "33x70": png(33, 70, seed=2)}


@pytest.fixture(scope="module")
def projector(smollm2, tmp_path_factory) -> Path:
    return write_projector(smollm2, tmp_path_factory.mktemp("projector") / "mmproj.gguf", seed=1).path


def whole(model: Path) -> StageConfig:
    (config,) = split_configs(model, [(0, 30)], None, **SETTINGS)
    return config


@pytest.fixture(scope="module")
def reference(smollm2, projector):
    ref = MultimodalReference(whole(smollm2), projector, logits_all=True)
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def head_reference(smollm2, projector):
    """The reference with a head's output rows: the last of each batch."""
    ref = MultimodalReference(whole(smollm2), projector, logits_all=False)
    yield ref
    ref.close()


def split_greedy(chain: Chain, session: str, prompt: str, images: list[bytes],
                 n_tokens: int) -> tuple[int, list[np.ndarray], list[int]]:
    """The head's projector encodes the prompt; its text and each image go in batches of their own
    (as the head's scheduler cuts them), every text row an output as ``Llama.eval``'s are."""
    encoded = chain.head.projector.prompt(prompt, images)
    tokens = encoded.tokens
    cuts = sorted({0, len(tokens), *(m.start for m in encoded.media), *(m.end for m in encoded.media)})
    for start, end in zip(cuts, cuts[1:]):
        image = next((m for m in encoded.media if m.start == start), None)
        last = end == len(tokens)
        fed = [PLACEHOLDER_TOKEN] * (end - start) if image is not None else tokens[start:end]
        (result,) = chain.step([Step(session, start, fed, want_logits=last, sample=last, all_rows=image is None,
                                     embd=None if image is None else image.rows)])
    rows, out = [result.logits], [result.token]
    while len(out) < n_tokens:
        (result,) = chain.step([Step(session, len(tokens) + len(out) - 1, [out[-1]], all_rows=True)])
        rows.append(result.logits)
        out.append(result.token)
    chain.drop(session)
    return len(tokens), rows, out


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_split_reads_an_image_bit_for_bit_as_the_unsplit_model(split, smollm2, slice_cache, projector, reference):
    """2 images x 2 prompts on this split: every step's logits equal the one-process reference's
    (max |diff| 0.0), the prompt takes as many positions, the greedy tokens are the same."""
    configs = split_configs(smollm2, SPLITS[split], slice_cache, **SETTINGS)
    configs[0] = dataclasses.replace(configs[0], projector_path=str(projector))
    chain = Chain(configs)
    table = []
    try:
        for p, prompt in enumerate(PROMPTS):
            for name, image in IMAGES.items():
                length, rows, tokens = split_greedy(chain, f"s{p}-{name}", prompt, [image], N_TOKENS)
                ref_length, ref_rows, ref_tokens = reference.greedy(prompt, [image], N_TOKENS)
                diff = max(float(np.abs(a - b).max()) for a, b in zip(rows, ref_rows))
                table.append((name, p, split, diff))
                assert length == ref_length
                assert tokens == ref_tokens, f"prompt {p}, image {name}"
                assert diff == 0.0, f"prompt {p}, image {name}: max |logit diff| {diff}"
    finally:
        chain.close()
    print("\n".join(f"image {n} prompt {p} split {s}: max |logit diff| {d}" for n, p, s, d in table))


def test_two_images_read_differently_and_each_as_the_reference_reads_it(smollm2, slice_cache, projector, reference):
    """The image matters (another image, other logits), and a prompt with two images is exact too."""
    configs = split_configs(smollm2, SPLITS["0:10/10:30"], slice_cache, **SETTINGS)
    configs[0] = dataclasses.replace(configs[0], projector_path=str(projector))
    chain = Chain(configs)
    try:
        prompt = "<|im_start|>user\nCompare <__media__> with <__media__>.<|im_end|>\n<|im_start|>assistant\n"
        both = list(IMAGES.values())
        length, rows, tokens = split_greedy(chain, "two", prompt, both, N_TOKENS)
        ref_length, ref_rows, ref_tokens = reference.greedy(prompt, both, N_TOKENS)
        assert tokens == ref_tokens and max(float(np.abs(a - b).max()) for a, b in zip(rows, ref_rows)) == 0.0
        _, swapped_rows, _ = split_greedy(chain, "swapped", prompt, both[::-1], N_TOKENS)
        assert not np.array_equal(swapped_rows[0], rows[0])
    finally:
        chain.close()


def test_image_rows_are_refused_at_a_head_without_a_projector(smollm2, slice_cache):
    """Embedding rows at stage 0 are the head's own image rows: a head without a projector takes none."""
    from skippy_stage.errors import InvalidRequestError
    from skippy_stage.model.batch import BatchEntry

    runtime = StageRuntime(split_configs(smollm2, [(0, 10), (10, 30)], slice_cache, **SETTINGS)[0])
    try:
        rows = np.zeros((2, runtime.n_embd), dtype=np.float32)
        with pytest.raises(InvalidRequestError, match=r"entries\[0\]\.hidden is not accepted .*no projector_path"):
            runtime.run_batch([BatchEntry("s", np.arange(2), token_ids=[0, 0], hidden=rows)])
        assert runtime.lanes.lane_of("s") is None
    finally:
        runtime.close()


# -- the projector file and the config ----------------------------------------------------------------


def rewrite(source: Path, dest: Path, *, drop: str | None = None, key: tuple[str, object] | None = None) -> Path:
    """``source`` with tensor ``drop`` left out, or metadata ``key`` replaced (name, packed value)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(source))
    metadata = [(name, gguf_file.raw_value(field)) for name, field in reader.fields.items()
                if not name.startswith("GGUF.")]
    if key is not None:
        metadata = [(n, key[1] if n == key[0] else v) for n, v in metadata]
    tensors = [gguf_file.tensor_from_reader(reader, t, t.name) for t in reader.tensors if t.name != drop]
    gguf_file.write_gguf(dest, metadata, tensors)
    return dest


def head_config(smollm2, slice_cache, **fields) -> StageConfig:
    """The head of a 0:10 / 10:30 split (a runtime alone: nothing connects to its downstream)."""
    return dataclasses.replace(split_configs(smollm2, [(0, 10), (10, 30)], slice_cache, **SETTINGS)[0], **fields)


@pytest.mark.parametrize("case", ["int32 key", "no mm.2", "no position_embd", "another projector type",
                                  "a Qwen3-VL projector", "an M-RoPE projector beside a plain model"])
def test_a_projector_libmtmd_would_crash_on_is_refused_by_name_before_libmtmd_opens_it(
        case, smollm2, slice_cache, projector, tmp_path):
    """A u32 key written as INT32 aborts libmtmd, a missing mm.2 or position_embd segfaults it: each is
    refused naming the key or tensor, and the process lives on to say so."""
    from gguf import GGUFValueType

    if case == "int32 key":
        bad = rewrite(projector, tmp_path / "p.gguf",
                      key=("clip.vision.image_size", gguf_file.pack_value(GGUFValueType.INT32, 64)))
        match = r"clip\.vision\.image_size is INT32, libmtmd reads it as UINT32"
    elif case == "no mm.2":
        bad, match = rewrite(projector, tmp_path / "p.gguf", drop="mm.2.weight"), r"tensor mm\.2\.weight is missing"
    elif case == "no position_embd":
        bad = rewrite(projector, tmp_path / "p.gguf", drop="v.position_embd.weight")
        match = r"tensor v\.position_embd\.weight is missing"
    elif case == "another projector type":
        bad = rewrite(projector, tmp_path / "p.gguf",
                      key=("clip.projector_type", gguf_file.pack_value(GGUFValueType.STRING, "gemma3")))
        match = r"clip\.projector_type='gemma3' is not proven on a split head"
    elif case == "a Qwen3-VL projector":
        bad = rewrite(write_projector(smollm2, tmp_path / "q.gguf", seed=1, kind="qwen2vl").path, tmp_path / "p.gguf",
                      key=("clip.projector_type", gguf_file.pack_value(GGUFValueType.STRING, "qwen3vl_merger")))
        match = r"clip\.projector_type='qwen3vl_merger' is not taken: its image rows carry deepstack features"
    else:
        bad = write_projector(smollm2, tmp_path / "p.gguf", seed=1, kind="qwen2vl").path
        match = r"a qwen2vl_merger projector is for a text model with M-RoPE positions; this model's are plain"
    with pytest.raises(ConfigError, match=match):
        StageRuntime(head_config(smollm2, slice_cache, projector_path=str(bad)))


def test_projector_settings_are_checked_where_they_are_read(smollm2, slice_cache, projector):
    """A projector below the head, on a GPU this build lacks, or a budget its images cannot keep: refused
    by name at the config or at load."""
    with pytest.raises(ConfigError, match=r"projector_path=.* is for the head only"):
        StageConfig.from_dict({**dataclasses.asdict(head_config(smollm2, slice_cache)), "layer_start": 10,
                               "layer_end": 20, "stage_index": 1, "projector_path": str(projector)})
    with pytest.raises(ConfigError, match=r"projector_use_gpu=True this build runs the projector on the CPU only"):
        dataclasses.replace(head_config(smollm2, slice_cache), projector_path=str(projector), projector_use_gpu=True)
    with pytest.raises(ConfigError, match=r"media_marker='<img>' needs projector_path"):
        dataclasses.replace(head_config(smollm2, slice_cache), media_marker="<img>")
    with pytest.raises(ConfigError, match=r"image_max_tokens=8: this mlp projector makes every image 16 rows"):
        StageRuntime(head_config(smollm2, slice_cache, projector_path=str(projector), image_max_tokens=8))


def test_images_that_would_be_unsafe_to_decode_are_refused_from_their_header():
    """The size comes from the header, before a pixel is decoded: a 100000 x 100000 PNG is refused,
    bytes in no image format too, naming the field."""
    assert image_size(png(33, 70, seed=0)) == (33, 70)
    huge = bytearray(png(8, 8, seed=0))
    huge[16:24] = (100_000).to_bytes(4, "big") * 2
    with pytest.raises(InvalidFieldError, match=r"media\[3\] is 100000x100000 pixels"):
        check_image(bytes(huge), "media[3]")
    with pytest.raises(InvalidFieldError, match=r"media\[0\] \(11 bytes\) is not an image"):
        check_image(b"hello world", "media[0]")


# -- through real processes ---------------------------------------------------------------------------

MAX_TOKENS = 12
CHAT = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture? "},
                                     {"type": "image_url", "image_url": {"url": data_url(IMAGES["80x48"])}},
                                     {"type": "text", "text": " Describe it."}]}]


@pytest.fixture(scope="module")
def api(start_pipeline, smollm2, projector):
    port = free_ports("127.0.0.1", 1)[0]
    pipeline = start_pipeline(smollm2, [(0, 10), (10, 30)], http_port=[port, None],
                              projector_path=[str(projector), None], **{**SETTINGS, "n_threads": 1})
    return pipeline, f"http://127.0.0.1:{port}/v1"


def test_a_chat_with_an_image_answers_what_the_unsplit_model_answers(api, head_reference):
    """image_url parts (array content) through the OpenAI client at temperature 0: the text of the
    reference's greedy tokens, and usage counting the image's positions as prompt tokens."""
    _, base = api
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model="m", messages=CHAT, temperature=0, max_tokens=MAX_TOKENS)
    length, _, tokens = head_reference.greedy(head_reference.render(CHAT), [IMAGES["80x48"]], MAX_TOKENS)
    assert answer.choices[0].message.content == head_reference.text(tokens)
    assert answer.usage.prompt_tokens == length
    assert answer.usage.completion_tokens == MAX_TOKENS


def test_anthropic_image_blocks_answer_what_the_openai_image_parts_answer(api, head_reference):
    """The Messages API's base64 image block, between the same text blocks: the same rendered prompt,
    so the reference's text; count_tokens counts the image's positions."""
    import base64

    _, base = api
    blocks = [{"type": "text", "text": "What is in this picture? "},
              {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(IMAGES["80x48"]).decode()}},
              {"type": "text", "text": " Describe it."}]
    root = base.removesuffix("/v1")
    answer = post_to(f"{root}/v1/messages", {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 0,
                                             "messages": [{"role": "user", "content": blocks}]})
    length, _, tokens = head_reference.greedy(head_reference.render(CHAT), [IMAGES["80x48"]], MAX_TOKENS)
    assert answer["content"][0]["text"] == head_reference.text(tokens)
    # (Anthropic's input_tokens leave out what a resident prefix held: an earlier test may have left one)
    assert answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"] == length
    counted = post_to(f"{root}/v1/messages/count_tokens",
                      {"model": "m", "messages": [{"role": "user", "content": blocks}]})
    assert counted["input_tokens"] == length


def test_choices_of_a_prompt_with_an_image_share_its_prefill(api, head_reference):
    """n=2 at temperature 0: the prompt (image included) is prefilled once and each choice starts as a
    copy of its KV; both answer the reference's text."""
    _, base = api
    answer = post(base, {"messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS, "n": 2})
    _, _, tokens = head_reference.greedy(head_reference.render(CHAT), [IMAGES["80x48"]], MAX_TOKENS)
    assert [c["message"]["content"] for c in answer["choices"]] == [head_reference.text(tokens)] * 2


def test_a_prefix_with_an_image_is_kept_and_reused_only_for_the_same_image(api, head_reference):
    """The same chat again reuses the resident prefix up to its last token (image included); the
    same words with another image reuse only what comes before the image, and answer for that image."""
    pipeline, base = api
    again = post(base, {"messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS})
    first_length = again["usage"]["prompt_tokens"]
    same = post(base, {"messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert same["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == first_length - 1
    other = json.loads(json.dumps(CHAT).replace(data_url(IMAGES["80x48"]), data_url(IMAGES["33x70"])))
    answer = post(base, {"messages": other, "temperature": 0, "max_tokens": MAX_TOKENS})
    rendered = head_reference.render(other)
    _, _, tokens = head_reference.greedy(rendered, [IMAGES["33x70"]], MAX_TOKENS)
    assert answer["choices"][0]["message"]["content"] == head_reference.text(tokens)
    image_start = len(head_reference.llm.tokenize(rendered[: rendered.index("<__media__>")].encode(), special=True))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] <= image_start



def test_the_responses_api_takes_input_image_parts_and_keeps_them_for_the_next_turn(api):
    """input_image parts answer what the chat API's image_url parts answer; a turn that continues the
    stored response (previous_response_id) reads the image again, as the whole history sent to the
    chat API does; a bad image names the input part."""
    _, base = api
    parts = [{"type": "input_text", "text": "What is in this picture? "},
             {"type": "input_image", "image_url": data_url(IMAGES["80x48"]), "detail": "auto"},
             {"type": "input_text", "text": " Describe it."}]
    first = post_to(f"{base}/responses", {"input": [{"role": "user", "content": parts}], "temperature": 0,
                                          "max_output_tokens": MAX_TOKENS})
    chat = post(base, {"messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS})
    answer = chat["choices"][0]["message"]["content"]
    assert first["output"][0]["content"][0]["text"] == answer
    assert first["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    follow = "Now name its colours."
    second = post_to(f"{base}/responses", {"previous_response_id": first["id"], "input": follow, "temperature": 0,
                                           "max_output_tokens": MAX_TOKENS})
    whole = post(base, {"messages": [*CHAT, {"role": "assistant", "content": answer},
                                     {"role": "user", "content": follow}], "temperature": 0, "max_tokens": MAX_TOKENS})
    assert second["output"][0]["content"][0]["text"] == whole["choices"][0]["message"]["content"]
    assert second["usage"]["input_tokens"] == whole["usage"]["prompt_tokens"]
    noise = [{"role": "user", "content": [{"type": "input_text", "text": "Look: "},
                                          {"type": "input_image", "image_url": data_url(b"\x89PNG\r\n\x1a\n" + bytes(40))}]}]
    try:
        post_to(f"{base}/responses", {"previous_response_id": first["id"], "input": noise, "max_output_tokens": 2})
    except urllib.error.HTTPError as exc:
        status, error = exc.code, json.loads(exc.read())["error"]
    assert status == 400 and error["param"] == "input[0].content[1].image_url", error

def test_generate_takes_images_as_media_bytes(api, head_reference):
    """gRPC Generate: a prompt with the marker and the image's bytes answers the reference's text."""
    pipeline, _ = api
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        request = stage_pb2.GenerateRequest(prompt=PROMPTS[1], max_tokens=MAX_TOKENS, media=[IMAGES["33x70"]],
                                            sampling=stage_pb2.SamplingParams(temperature=0))
        replies = list(stub.Generate(request, timeout=120))
    _, _, tokens = head_reference.greedy(PROMPTS[1], [IMAGES["33x70"]], MAX_TOKENS)
    assert [t for r in replies for t in r.token_ids] == tokens
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(stage_pb2.GenerateRequest(prompt="no marker here", media=[IMAGES["33x70"]]),
                               timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "0 media markers" in refused.value.details()


def post(base: str, body: dict) -> dict:
    return post_to(f"{base}/chat/completions", body)


def post_to(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def refusal(base: str, body: dict) -> tuple[int, dict]:
    try:
        post(base, body)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]
    raise AssertionError("the request was not refused")


def test_bad_images_are_refused_naming_the_part_and_the_head_serves_on(api, head_reference):
    """An image that does not decode, an http URL the head may not fetch, more images than a session
    holds: 400 naming the message part; the next request is answered."""
    _, base = api
    noise = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(b"\x89PNG\r\n\x1a\n"
                                                                                               + bytes(40))}}]}]
    status, error = refusal(base, {"messages": noise, "max_tokens": 4})
    assert status == 400 and error["param"] == "messages[0].content[0].image_url.url"
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]
    status, error = refusal(base, {"messages": remote, "max_tokens": 4})
    assert status == 400 and "media_url_fetch is off" in error["message"]
    many = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGES["80x48"])}}] * 130}]
    status, error = refusal(base, {"messages": many, "max_tokens": 4})
    assert status == 400 and error["param"] == "messages[0].content[0].image_url.url"
    assert "130 images take 2080 positions" in error["message"] and "a session holds at most 2048" in error["message"]
    models = json.loads(urllib.request.urlopen(f"{base}/models", timeout=30).read())
    assert "multimodal" in models["data"][0]["capabilities"]
    answer = post(base, {"messages": CHAT, "temperature": 0, "max_tokens": 2})
    assert answer["usage"]["completion_tokens"] == 2
