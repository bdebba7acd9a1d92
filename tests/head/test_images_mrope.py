"""Images with M-RoPE positions (Qwen2-VL): a split reads them exactly as the unsplit model does.

A Qwen2-VL projector makes an image a grid of rows (merged 2x2 patches, raster order) that takes
max(width, height) model positions: every row sits at the image's first position with 2-D offsets,
and the text after the image starts that many positions on. The head encodes the image; every stage
places its rows from the grid each image entry carries, and keeps per lane where the images are, so
trims, forks and resident prefixes (which count rows) cut at the right model position.

The reference is llama-cpp-python's own multimodal path in one process (``MultimodalReference``:
``MTMDChatHandler``'s libmtmd context, ``mtmd_helper_eval_chunk_single`` per image). No Qwen2-VL ships
on PyPI: the model is the random-weight ``qwen2vl-dense`` fixture the architecture proofs use (with a
chat template added for the API tests) and the projector ``make-projector --kind qwen2vl``'s.
"""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from support.chain import Chain, Step, split_configs
from support.images import data_url, png

from skippy_stage.cli.local import free_ports
from skippy_stage.errors import InvalidRequestError, PrefixMissError, SessionStateError
from skippy_stage.model import gguf_file, synthetic
from skippy_stage.model.batch import BatchEntry
from skippy_stage.model.mrope import ImageGrid
from skippy_stage.model.multimodal_reference import MultimodalReference
from skippy_stage.model.projector import PLACEHOLDER_TOKEN
from skippy_stage.model.projector_fixture import write_projector
from skippy_stage.model.runtime import StageRuntime
from skippy_stage.v1 import stage_pb2, stage_pb2_grpc

ARCHS = Path(__file__).resolve().parent.parent / "fixtures" / "archs.jsonl.gz"
N_TOKENS = 8
SETTINGS = {"flash_attn_type": "disabled", "n_threads": 2}
SPLITS = {"0:2/2:6": [(0, 2), (2, 6)], "0:1/1:3/3:6": [(0, 1), (1, 3), (3, 6)]}
PROMPTS = ["tok_1 tok_2 tok_3 <__media__> tok_4 tok_5 tok_6 tok_7",
           "<__media__>tok_9 tok_8 tok_7 tok_6 tok_5 tok_4 tok_3 tok_2 tok_1"]
# 80x48 pixels: a 5x3 grid (15 rows, 5 positions); 200x120: 13x8 (104 rows, 13 positions).
IMAGES = {"80x48": png(80, 48, seed=1), "200x120": png(200, 120, seed=2)}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory) -> Path:
    """The random-weight Qwen2-VL text model, with a chat template for the API tests."""
    folder = tmp_path_factory.mktemp("qwen2vl")
    plain = synthetic.write_model(synthetic.load_specs(ARCHS)["qwen2vl-dense"], folder / "plain.gguf", seed=42)
    reader = GGUFReader(str(plain))
    metadata = [(name, gguf_file.raw_value(field)) for name, field in reader.fields.items()
                if not name.startswith("GGUF.")]
    metadata.append(("tokenizer.chat_template", gguf_file.pack_value(GGUFValueType.STRING, TEMPLATE)))
    tensors = [gguf_file.tensor_from_reader(reader, t, t.name) for t in reader.tensors]
    gguf_file.write_gguf(folder / "qwen2vl.gguf", metadata, tensors)
    return folder / "qwen2vl.gguf"


@pytest.fixture(scope="module")
def merger(qwen2vl, tmp_path_factory) -> Path:
    return write_projector(qwen2vl, tmp_path_factory.mktemp("merger") / "mmproj.gguf", seed=1, kind="qwen2vl").path


def whole(model: Path):
    (config,) = split_configs(model, [(0, 6)], None, **SETTINGS)
    return config


@pytest.fixture(scope="module")
def reference(qwen2vl, merger):
    ref = MultimodalReference(whole(qwen2vl), merger, logits_all=True)
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def head_reference(qwen2vl, merger):
    """The reference with a head's output rows: the last of each batch."""
    ref = MultimodalReference(whole(qwen2vl), merger, logits_all=False)
    yield ref
    ref.close()


def chain_of(model: Path, merger: Path, split: str, slice_cache: Path, **fields) -> Chain:
    configs = split_configs(model, SPLITS[split], slice_cache, **SETTINGS)
    configs[0] = dataclasses.replace(configs[0], projector_path=str(merger), **fields)
    return Chain(configs)


def prefill(chain: Chain, session: str, prompt: str, images: list[bytes], *, slice_rows: int | None = None,
            start: int = 0, prefix_id: str | None = None):
    """The head's projector encodes the prompt; its text and each image go in entries of their own (an
    image in slices of ``slice_rows`` with ``slice_rows``), as the head's scheduler cuts them; every text
    row an output as ``Llama.eval``'s are. Returns the encoded prompt and the last entry's result."""
    encoded = chain.head.projector.prompt(prompt, images)
    cuts = {0, len(encoded.tokens), start}
    for m in encoded.media:
        cuts |= {m.start, m.end, *(range(m.start, m.end, slice_rows) if slice_rows else ())}
    cuts = sorted(c for c in cuts if c >= start)
    result = None
    for first, end in zip(cuts, cuts[1:]):
        image = next((m for m in encoded.media if m.start <= first < m.end), None)
        last = end == len(encoded.tokens)
        if image is None:
            step = Step(session, first, encoded.tokens[first:end], want_logits=last, sample=last, all_rows=True,
                        prefix_id=prefix_id)
        else:
            step = Step(session, first, [PLACEHOLDER_TOKEN] * (end - first), want_logits=last, sample=last,
                        embd=image.rows[first - image.start : end - image.start], prefix_id=prefix_id,
                        image=ImageGrid(*image.grid, first_row=first - image.start))
        (result,) = chain.step([step])
        prefix_id = None
    return encoded, result


def split_greedy(chain: Chain, session: str, prompt: str, images: list[bytes], n_tokens: int,
                 **how) -> tuple[int, list[np.ndarray], list[int]]:
    encoded, result = prefill(chain, session, prompt, images, **how)
    rows, out = [result.logits], [result.token]
    while len(out) < n_tokens:
        (result,) = chain.step([Step(session, len(encoded.tokens) + len(out) - 1, [out[-1]], all_rows=True)])
        rows.append(result.logits)
        out.append(result.token)
    chain.drop(session)
    positions = len(encoded.tokens) - sum(m.rows.shape[0] - max(m.grid) for m in encoded.media)
    return positions, rows, out


def max_diff(rows: list[np.ndarray], ref_rows: list[np.ndarray]) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(rows, ref_rows))


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_split_reads_an_m_rope_image_bit_for_bit_as_the_unsplit_model(split, qwen2vl, merger, slice_cache,
                                                                        reference):
    """2 images x 2 prompts on this split: every step's logits equal the one-process reference's (max
    |diff| 0.0), the prompt takes as many model positions (fewer than its rows), the greedy tokens match."""
    chain = chain_of(qwen2vl, merger, split, slice_cache)
    table = []
    try:
        for p, prompt in enumerate(PROMPTS):
            for name, image in IMAGES.items():
                positions, rows, tokens = split_greedy(chain, f"s{p}-{name}", prompt, [image], N_TOKENS)
                ref_positions, ref_rows, ref_tokens = reference.greedy(prompt, [image], N_TOKENS)
                diff = max_diff(rows, ref_rows)
                table.append((name, p, split, diff))
                assert positions == ref_positions
                assert tokens == ref_tokens, f"prompt {p}, image {name}"
                assert diff == 0.0, f"prompt {p}, image {name}: max |logit diff| {diff}"
    finally:
        chain.close()
    print("\n".join(f"image {n} prompt {p} split {s}: max |logit diff| {d}" for n, p, s, d in table))


def test_an_image_fed_in_slices_and_two_images_in_one_prompt_are_exact(qwen2vl, merger, slice_cache, reference):
    """An image longer than a batch goes in slices (each an entry naming its first row on the grid):
    the same logits; a prompt with two images is exact too, and the images swapped read otherwise."""
    chain = chain_of(qwen2vl, merger, "0:1/1:3/3:6", slice_cache)
    try:
        prompt = PROMPTS[0]
        _, rows, tokens = split_greedy(chain, "sliced", prompt, [IMAGES["200x120"]], N_TOKENS, slice_rows=24)
        _, ref_rows, ref_tokens = reference.greedy(prompt, [IMAGES["200x120"]], N_TOKENS)
        assert tokens == ref_tokens and max_diff(rows, ref_rows) == 0.0
        two = "tok_1 <__media__> tok_2 tok_3 <__media__> tok_4"
        both = list(IMAGES.values())
        positions, rows, tokens = split_greedy(chain, "two", two, both, N_TOKENS, slice_rows=40)
        ref_positions, ref_rows, ref_tokens = reference.greedy(two, both, N_TOKENS)
        assert (positions, tokens) == (ref_positions, ref_tokens) and max_diff(rows, ref_rows) == 0.0
        _, swapped, _ = split_greedy(chain, "swapped", two, both[::-1], N_TOKENS)
        assert not np.array_equal(swapped[0], rows[0])
    finally:
        chain.close()



def test_the_image_token_budget_scales_an_m_rope_image_into_it(qwen2vl, merger, slice_cache):
    """image_min_tokens/image_max_tokens reach libmtmd: the 200x120 image (104 rows by default) becomes
    at most 16 rows, or at least 300, still a grid; a budget below libmtmd's smallest Qwen2-VL image is
    refused at start naming the field."""
    from skippy_stage.errors import ConfigError

    head = split_configs(qwen2vl, SPLITS["0:2/2:6"], slice_cache, **SETTINGS)[0]
    for fields, check in (({"image_max_tokens": 16}, lambda n: 8 <= n <= 16),
                          ({"image_min_tokens": 300}, lambda n: n >= 300)):
        runtime = StageRuntime(dataclasses.replace(head, projector_path=str(merger), **fields))
        try:
            (span,) = runtime.projector.prompt("<__media__>", [IMAGES["200x120"]]).media
            assert check(span.rows.shape[0]) and span.rows.shape[0] == span.grid[0] * span.grid[1], (fields, span.grid)
        finally:
            runtime.close()
    with pytest.raises(ConfigError, match=r"image_max_tokens=4: a qwen2vl_merger projector makes an image at least 8"):
        StageRuntime(dataclasses.replace(head, projector_path=str(merger), image_max_tokens=4))

def lanes_of(chain: Chain, session: str) -> list[int | None]:
    return [None if (bound := stage.lanes.lane_of(session)) is None else bound.n_tokens for stage in chain.stages]


def test_a_session_is_cut_forked_and_kept_as_a_prefix_only_outside_its_images(qwen2vl, merger, slice_cache,
                                                                              reference):
    """Rows count as everywhere else: a trim inside an image is refused on every stage (its rows share
    one model position) and the session is left as it was; a trim to the image's start drops it whole,
    and feeding it again gives the reference's logits; a fork copies the image (its next row's logits
    are the source's for the same row); a resident prefix is taken up to past the image (the logits of
    the same rows fed on a session cut there), and refused inside it."""
    prompt, image = PROMPTS[0], IMAGES["80x48"]
    _, ref_rows, _ = reference.greedy(prompt, [image], 1)
    chain = chain_of(qwen2vl, merger, "0:2/2:6", slice_cache)

    def cut(session: str, keep: int) -> None:
        for stage in chain.stages:
            stage.trim_session(session, keep)

    try:
        encoded, _ = prefill(chain, "a", prompt, [image])
        span, length, tokens = encoded.media[0], len(encoded.tokens), encoded.tokens
        for stage in chain.stages:
            with pytest.raises(InvalidRequestError, match=rf"tokens={span.start + 4} .*inside an image's rows"):
                stage.trim_session("a", span.start + 4)
        assert lanes_of(chain, "a") == [length, length]
        cut("a", span.start)
        _, again = prefill(chain, "a", prompt, [image], start=span.start)
        assert np.array_equal(again.logits, ref_rows[0])

        cut("a", length - 1)
        (alone,) = chain.step([Step("a", length - 1, tokens[-1:])])
        (forked,) = chain.step([Step("b", length - 1, tokens[-1:], fork_of="a")])
        assert np.array_equal(forked.logits, alone.logits)

        keep = span.end + 1
        cut("b", keep)
        (rest,) = chain.step([Step("b", keep, tokens[keep:])])
        for stage in chain.stages:
            stage.retire_session("a")
        (taken,) = chain.step([Step("c", keep, tokens[keep:], prefix_id="a")])
        assert np.array_equal(taken.logits, rest.logits)
        for stage in chain.stages:
            stage.retire_session("c")
        with pytest.raises(PrefixMissError, match=rf"prefix_id='c' could not be cut to {span.start + 2} tokens"):
            chain.step([Step("d", span.start + 2, [PLACEHOLDER_TOKEN] * 2, prefix_id="c",
                             embd=span.rows[2:4], image=ImageGrid(*span.grid, first_row=2))])
        assert lanes_of(chain, "d") == [None, None]
    finally:
        chain.close()


def test_image_entries_that_do_not_fit_the_session_are_refused_and_nothing_leaks(qwen2vl, merger, slice_cache):
    """A slice naming an image the session never began, a grid whose rows the entry passes, a rewind
    into an image, text inside an unfinished image: refused naming the entry, and the lanes hold what
    they held. A session that holds part of an image is not exported as a KV page."""
    chain = chain_of(qwen2vl, merger, "0:2/2:6", slice_cache)
    try:
        encoded, _ = prefill(chain, "s", "tok_1 <__media__> tok_2", [IMAGES["80x48"]])
        held = lanes_of(chain, "s")
        rows = chain.head.projector.prompt("<__media__>", [IMAGES["80x48"]]).media[0].rows
        n = len(encoded.tokens)
        with pytest.raises(InvalidRequestError, match=r"entries\[0\]\.image\.first_row=3: this session has no 5x3"):
            chain.step([Step("s", n, [PLACEHOLDER_TOKEN] * 4, embd=rows[3:7], image=ImageGrid(5, 3, 3))])
        with pytest.raises(InvalidRequestError, match=r"entries\[0\]\.image\.first_row=12 with 4 rows passes"):
            chain.step([Step("s", n, [PLACEHOLDER_TOKEN] * 4, embd=rows[:4], image=ImageGrid(5, 3, 12))])
        assert lanes_of(chain, "s") == held
        inner = chain.stages[1]
        inside = encoded.media[0].start + 2
        with pytest.raises(SessionStateError, match=rf"entries\[0\]\.rewind to positions\[0\]={inside}: .* holds an "
                                                    r"image's rows there"):
            inner.run_batch([BatchEntry("s", np.arange(inside, inside + 2), token_ids=[1, 2], rewind=True,
                                        hidden=np.zeros((2, inner.n_embd), dtype=np.float32))])
        assert lanes_of(chain, "s") == held
        chain.step([Step("t", 0, [PLACEHOLDER_TOKEN] * 4, embd=rows[:4], image=ImageGrid(5, 3))])
        with pytest.raises(InvalidRequestError, match=r"entries\[0\] starts at row 4, inside the image at rows "
                                                      r"0\.\.15 this session has not finished"):
            chain.step([Step("t", 4, [1, 2])])
        assert lanes_of(chain, "t") == [4, 4]
        with pytest.raises(SessionStateError, match=r"session_id='t' holds part of an image on stage stage-1"):
            chain.stages[1].export_session("t", 1 << 30)
    finally:
        chain.close()



def test_a_session_with_an_image_moves_as_a_kv_page_and_goes_on_exactly(qwen2vl, merger, slice_cache):
    """ExportSession / ImportSession (a drain's hand-off) carry where the images are: the imported
    session's next step gives the exporter's logits bit for bit. A page whose images pass its rows is
    refused naming them, one that leaves them out does not match llama.cpp's cells; neither holds a lane."""
    chain = chain_of(qwen2vl, merger, "0:2/2:6", slice_cache)
    final = chain.stages[1]
    stand_in = StageRuntime(final.config)
    try:
        encoded, first = prefill(chain, "s", PROMPTS[0], [IMAGES["80x48"]])
        n = len(encoded.tokens)
        page = final.export_session("s", 1 << 30)
        assert page.images == ((encoded.media[0].start, 5, 3),)
        assert stand_in.import_session("s", page) == n
        (row,) = chain.head.run_batch([BatchEntry("s", np.arange(n, n + 1), token_ids=[first.token])])
        here, there = ([*stage.run_batch([BatchEntry("s", np.arange(n, n + 1), token_ids=[first.token], hidden=row.hidden,
                                                     want_logits=True, sample=True)])][0] for stage in (final, stand_in))
        assert np.array_equal(here.logits, there.logits) and here.token == there.token
        with pytest.raises(InvalidRequestError, match=rf"page\.images\[0\] at row {n - 2} \(5x3\) .* passes the page's "
                                                      rf"{n} rows"):
            stand_in.import_session("other", dataclasses.replace(page, images=((n - 2, 5, 3),)))
        with pytest.raises(InvalidRequestError, match=r"page\.data \(\d+ bytes\) is not a KV state"):
            stand_in.import_session("other", dataclasses.replace(page, images=()))
        assert stand_in.lanes.lane_of("other") is None
    finally:
        stand_in.close()
        chain.close()

@pytest.mark.parametrize(("model", "message"), [
    ("smollm2", r"entries\[0\]\.image: stage stage-1's model has no M-RoPE"),
    # Qwen3.5 takes M-RoPE positions but keeps a recurrent state, which cannot drop an image fed in part.
    ("qwen35", r"entries\[0\]\.image: stage stage-1 holds a recurrent model"),
])
def test_an_image_grid_is_refused_where_no_image_can_be_placed_and_cut(model, message, request, slice_cache,
                                                                       tmp_path):
    """A model without M-RoPE positions, or with a recurrent state: an image entry is refused naming the
    field, and no lane is held."""
    if model == "smollm2":
        path, ranges = request.getfixturevalue("smollm2"), [(0, 10), (10, 30)]
    else:
        spec = synthetic.load_specs(ARCHS)["qwen35-dense"]
        path, ranges = synthetic.write_model(spec, tmp_path / "qwen35.gguf", seed=3), [(0, 2), (2, 6)]
    runtime = StageRuntime(split_configs(path, ranges, slice_cache, **SETTINGS)[1])
    try:
        hidden = np.zeros((2, runtime.n_embd), dtype=np.float32)
        with pytest.raises(InvalidRequestError, match=message):
            runtime.run_batch([BatchEntry("s", np.arange(2), token_ids=[0, 0], hidden=hidden, image=ImageGrid(2, 1))])
        assert runtime.lanes.lane_of("s") is None
    finally:
        runtime.close()


# -- through real processes ---------------------------------------------------------------------------

MAX_TOKENS = 10
CHAT = [{"role": "user", "content": [{"type": "text", "text": "tok_1 tok_2 "},
                                     {"type": "image_url", "image_url": {"url": data_url(IMAGES["200x120"])}},
                                     {"type": "text", "text": " tok_3 tok_4"}]}]


@pytest.fixture(scope="module")
def api(start_pipeline, qwen2vl, merger):
    """Qwen2-VL in three serve processes, the head with the projector; its batches of 32 rows cut the
    200x120 image (104 rows) into slices."""
    port = free_ports("127.0.0.1", 1)[0]
    pipeline = start_pipeline(qwen2vl, SPLITS["0:1/1:3/3:6"], http_port=[port, None, None],
                              projector_path=[str(merger), None, None], n_batch=32, n_ubatch=32,
                              **{**SETTINGS, "n_threads": 1})
    return pipeline, f"http://127.0.0.1:{port}/v1"


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_a_chat_with_an_m_rope_image_answers_what_the_unsplit_model_answers(api, head_reference):
    """image_url through the OpenAI API at temperature 0: the reference's text; usage counts the image's
    rows (the KV cells it takes). Again: the resident prefix is reused up to the prompt's last token.
    Two choices: the prompt prefilled once, each choice a copy of its KV, both the reference's text."""
    _, base = api
    answer = post(f"{base}/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS})
    _, _, tokens = head_reference.greedy(head_reference.render(CHAT), [IMAGES["200x120"]], MAX_TOKENS)
    text = head_reference.text(tokens)
    assert answer["choices"][0]["message"]["content"] == text
    rows = answer["usage"]["prompt_tokens"]
    same = post(f"{base}/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert same["choices"][0]["message"]["content"] == text
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == rows - 1
    two = post(f"{base}/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS, "n": 2})
    assert [c["message"]["content"] for c in two["choices"]] == [text, text]


def test_generate_with_an_m_rope_image_in_the_prompt_gives_the_reference_tokens(api, head_reference):
    """gRPC Generate with the image last in the prompt, and another image the resident prefixes do not
    hold: the reference's greedy tokens; the prefix kept from the chat is reused only before its image."""
    pipeline, _ = api
    prompt = "tok_5 tok_6 <__media__>"
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        request = stage_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, media=[IMAGES["80x48"]],
                                            sampling=stage_pb2.SamplingParams(temperature=0))
        replies = list(stub.Generate(request, timeout=120))
    _, _, tokens = head_reference.greedy(prompt, [IMAGES["80x48"]], MAX_TOKENS)
    assert [t for r in replies for t in r.token_ids] == tokens


@pytest.mark.parametrize(("grid", "rows", "message"), [
    ((0, 3, 0), 1, r"entries\[0\]\.image is 0x3: each side must be in \[1, 4096\]"),
    ((5000, 1, 0), 1, r"entries\[0\]\.image is 5000x1: each side"),
    ((4096, 4096, 0), 1, r"entries\[0\]\.image is 4096x4096 = 16777216 rows; at most 4096"),
    ((5, 3, 14), 4, r"entries\[0\]\.image\.first_row=14 with 4 rows passes the image's 15 rows"),
    ((5, 3, 3), 4, r"entries\[0\]\.image\.first_row=3: this session has no 5x3 image begun at row -3"),
])
def test_a_stage_refuses_a_hostile_image_grid_by_name_and_serves_on(api, grid, rows, message):
    """An IterationBatch straight to an inner stage with a grid it cannot place: INVALID_ARGUMENT naming
    the entry's field; no lane is held after it, and the stage answers the next call."""
    from skippy_stage.stage import codec, wire

    pipeline, _ = api
    inner = str(pipeline.configs[1]["bind_addr"])
    desc = wire.make_descriptor(dtype="f32", producer_stage_index=0, layer_start=0, layer_end=1, token_count=rows,
                                sequence_count=1, width=256)
    entry = stage_pb2.BatchEntry(session_id="hostile", positions=list(range(rows)), token_ids=[0] * rows)
    entry.image.width, entry.image.height, entry.image.first_row = grid
    request = stage_pb2.IterationBatchRequest(request_id="h", entries=[entry])
    request.frame.descriptor.CopyFrom(codec.descriptor_to_pb(desc))
    request.frame.payload = wire.encode(np.ones((rows, 256), dtype=np.float32), "f32")
    with grpc.insecure_channel(inner) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.IterationBatch(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(message, refused.value.details()), refused.value.details()
        status = stub.GetStatus(stage_pb2.GetStatusRequest(), timeout=30)
    assert "hostile" not in [lane.session_id for lane in status.lanes if lane.state == "active"]

