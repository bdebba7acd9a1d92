"""A stage that quantizes its own slice computes what the whole model quantized once computes.

``checkpoint_quantization`` makes each stage quantize its slice with llama.cpp's
``llama_model_quantize``, every tensor pinned to the type the whole model's quantization gives it
(``skippy_stage.model.requantize``). Proof: a chain of stage runtimes loading the requantized stage
files gives bit-identical logits (max |diff| == 0.0) and the same greedy tokens as llama-cpp-python on
the unsplit model quantized once to the same type. The source is llama.cpp's own full-precision
``llama`` test model (tests/fixtures/archs.jsonl.gz, regenerated from its seed), and the packaged
SmolLM2 (Q4_1) requantized to Q4_K_M. Also: why the pinning matters (a slice quantized alone gets
other types), stages at different types, and importance matrices (computed for the fixture model as
llama-imatrix computes one, checked by sha256, required by the IQ2 types). The same from a layer
package: stages that hold only their own parts plan from the whole model's header written from the
manifest and the metadata part, and compute what the whole model quantized once computes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from support.chain import Chain, split_configs
from support.imatrix import compute_imatrix
from support.packages import PackageServer
from support.reference import Reference, chain_greedy, max_diff

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError
from skippy_stage.model import package_stage, requantize, synthetic
from skippy_stage.model.package import MANIFEST_NAME, write_package
from skippy_stage.model.slicing import read_model_info, stage_file
from skippy_stage.model.stage_file import resolve_stage_file

SPECS = synthetic.load_specs(Path(__file__).resolve().parent.parent / "fixtures" / "archs.jsonl.gz")
PROMPT = [1, 17, 42, 5, 99, 23, 64, 8, 3, 77, 12, 31]
N_TOKENS = 8
SPLIT = [(0, 2), (2, 3), (3, 6)]  # a 2-layer head: quantized alone, its layer 1 would get more bits


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    """llama.cpp's test-llama-archs llama model: 6 layers, n_embd 256, every tensor F32."""
    path = tmp_path_factory.mktemp("requantize") / "llama-dense.gguf"
    synthetic.write_model(SPECS["llama-dense"], path, seed=42)
    return path


def tensor_types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def reference_run(model: Path, prompt: list[int], n_tokens: int) -> tuple[list[np.ndarray], list[int]]:
    """llama-cpp-python on ``model`` with the stages' context: each step's logits and the greedy tokens."""
    (cfg,) = split_configs(model, [(0, read_model_info(model).block_count)], None, kv_unified=False)
    reference = Reference(cfg)
    try:
        return reference.greedy_alone(prompt, n_tokens)
    finally:
        reference.close()


def split_run(configs: list[StageConfig], prompt: list[int], n_tokens: int) -> tuple[list[np.ndarray], list[int]]:
    chain = Chain(configs)
    try:
        rows, generated, _ = chain_greedy(chain, {"s": prompt}, n_tokens)
        return rows["s"], generated["s"]
    finally:
        chain.close()


@pytest.mark.parametrize("quantization", ["Q8_0", "Q4_K_M", "Q4_0"])
def test_stages_quantizing_their_own_slices_equal_the_whole_model_quantized_once(
        quantization, dense, tmp_path, slice_cache):
    whole = tmp_path / f"whole.{quantization}.gguf"
    requantize.quantize_file(dense, whole, quantization, nthread=2)
    ref_rows, ref_tokens = reference_run(whole, PROMPT, N_TOKENS)

    configs = split_configs(dense, SPLIT, slice_cache, kv_unified=False, checkpoint_quantization=quantization)
    rows, tokens = split_run(configs, PROMPT, N_TOKENS)

    diff = max_diff(rows, ref_rows)
    print(f"{quantization}: split {SPLIT} vs whole model quantized once: max |logit diff| = {diff}")
    assert diff == 0.0
    assert tokens == ref_tokens
    whole_types, source_types = tensor_types(whole), tensor_types(dense)
    for cfg in configs:  # every stage file holds the whole quantized model's tensor types, but for a
        path, _, _ = resolve_stage_file(cfg)  # token_embd.weight the stage does not use: kept as it was
        held = tensor_types(path)
        for name, type_name in held.items():
            if name == "token_embd.weight" and not requantize.uses_token_embd(
                    cfg.layer_start == 0, cfg.include_output, held):
                assert type_name == source_types[name], cfg.stage_id
                continue
            i = name.split(".")[1] if name.startswith("blk.") else None
            whole_name = name if i is None else name.replace(f"blk.{i}.", f"blk.{int(i) + cfg.layer_start}.", 1)
            assert type_name == whole_types[whole_name], (cfg.stage_id, name)


def test_a_slice_quantized_alone_gets_other_types_and_the_plan_pins_the_whole_models(dense, tmp_path, slice_cache):
    """Q4_K_M gives attn_v and ffn_down more bits by layer index and count (use_more_bits): the 2-layer
    slice 0:2 alone would put its layer 1 in the last eighth; pinned, it keeps the whole model's types."""
    plan = requantize.whole_model_plan(dense, "Q4_K_M")
    head = stage_file(dense, 0, 2, final=False, cache_dir=slice_cache).path
    alone = tmp_path / "alone.gguf"
    requantize.quantize_file(head, alone, "Q4_K_M")
    alone_types = tensor_types(alone)
    want = plan.for_slice(0, 2, list(alone_types))
    differ = {n: (alone_types[n], want[n]) for n in want if alone_types[n] != want[n]}
    print(f"slice 0:2 quantized alone vs in the whole model: {differ}")
    assert "blk.1.attn_v.weight" in differ  # Q6_K alone, Q4_K in the whole model

    (cfg, _) = split_configs(dense, [(0, 2), (2, 6)], slice_cache, checkpoint_quantization="Q4_K_M")
    path, _, _ = resolve_stage_file(cfg)
    assert tensor_types(path) == want


def test_stages_at_different_types_equal_one_model_quantized_with_those_types(dense, tmp_path, slice_cache):
    """Stage 0 at Q8_0, stage 1 at Q4_K_M: the reference is the whole model quantized once with each
    tensor pinned to the type its stage gives it (tt_overrides)."""
    configs = split_configs(dense, [(0, 3), (3, 6)], slice_cache, kv_unified=False)
    configs = [dataclasses.replace(c, checkpoint_quantization=q) for c, q in zip(configs, ("Q8_0", "Q4_K_M"))]
    pinned: dict[str, str] = {}
    for cfg in reversed(configs):  # token_embd as the head holds it, the rest from the stage that runs it
        path, _, _ = resolve_stage_file(cfg)
        for name, type_name in tensor_types(path).items():
            i = name.split(".")[1] if name.startswith("blk.") else None
            pinned[name if i is None else name.replace(f"blk.{i}.", f"blk.{int(i) + cfg.layer_start}.", 1)] = type_name
    mixed = tmp_path / "mixed.gguf"
    requantize.quantize_file(dense, mixed, "Q4_K_M", types=pinned)
    assert {tensor_types(mixed)[n] for n in ("blk.0.attn_q.weight", "blk.5.attn_q.weight")} == {"Q8_0", "Q4_K"}
    ref_rows, ref_tokens = reference_run(mixed, PROMPT, N_TOKENS)

    rows, tokens = split_run(configs, PROMPT, N_TOKENS)

    diff = max_diff(rows, ref_rows)
    print(f"Q8_0 0:3 + Q4_K_M 3:6 vs one model with those types: max |logit diff| = {diff}")
    assert diff == 0.0 and tokens == ref_tokens


IMATRIX_TEXT = (
    "A model that does not fit one machine is also a model nobody wants to download whole onto every "
    "machine, and the machines of one split rarely have the same memory: each should hold its layers at "
    "the precision that fits it. The importance matrix says which columns of each weight matter most."
)
IMATRIX_CHUNK = 32


@pytest.fixture(scope="module")
def imatrix(dense, tmp_path_factory) -> Path:
    """An importance matrix computed for the dense model as llama-imatrix computes one: the model run
    over ``IMATRIX_TEXT`` in chunks of 32 tokens, each weight's input squared and summed per column."""
    return compute_imatrix(dense, IMATRIX_TEXT, tmp_path_factory.mktemp("imatrix") / "imatrix.gguf",
                           chunk_size=IMATRIX_CHUNK)


def test_an_imatrix_computed_for_the_model_is_real(dense, imatrix):
    """Every matrix of every block has an entry of measured activations: one count, the tokens
    evaluated; sums positive and different per column; attn_q/k/v read the same input (the normed
    residual), so their sums are equal, and attn_output's (the attention's result) are not."""
    n_tokens = len(IMATRIX_TEXT) // IMATRIX_CHUNK * IMATRIX_CHUNK
    reader = gguf.GGUFReader(imatrix)
    assert reader.fields["general.type"].contents() == "imatrix"
    assert reader.fields["imatrix.chunk_count"].contents() == n_tokens // IMATRIX_CHUNK
    data = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1) for t in reader.tensors}
    matrices = sorted(t.name for t in gguf.GGUFReader(dense).tensors
                      if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2)
    assert len(matrices) == 6 * 7
    assert sorted(data) == sorted(f"{m}.{part}" for m in matrices for part in ("in_sum2", "counts"))
    for m in matrices:
        sums, counts = data[f"{m}.in_sum2"], data[f"{m}.counts"]
        assert counts.tolist() == [n_tokens], m
        assert (sums > 0).all() and np.unique(sums).size > sums.size // 2, m
    for i in range(6):
        q, k, v, out = (data[f"blk.{i}.attn_{n}.weight.in_sum2"] for n in ("q", "k", "v", "output"))
        assert np.array_equal(q, k) and np.array_equal(q, v) and not np.array_equal(q, out)
    assert not np.array_equal(data["blk.0.attn_q.weight.in_sum2"], data["blk.1.attn_q.weight.in_sum2"])


def test_an_imatrix_is_checked_then_used_and_the_iq2_types_need_one(dense, imatrix, tmp_path, slice_cache):
    sha = hashlib.sha256(imatrix.read_bytes()).hexdigest()

    with pytest.raises(ConfigError, match="checkpoint_imatrix=None must name an importance matrix"):
        split_configs(dense, SPLIT, slice_cache, checkpoint_quantization="IQ2_XXS")
    (bad, *_) = split_configs(dense, SPLIT, slice_cache, checkpoint_quantization="IQ2_XXS",
                              checkpoint_imatrix=str(imatrix), checkpoint_imatrix_sha256="0" * 64)
    with pytest.raises(ConfigError, match="checkpoint_imatrix_sha256='0+' does not match"):
        resolve_stage_file(bad)
    # IQ3_XS's default type needs none, but the plan puts attn_q/attn_k/ffn_up at IQ3_XXS, which does
    (iq3_xs, *_) = split_configs(dense, SPLIT, slice_cache, checkpoint_quantization="IQ3_XS")
    with pytest.raises(ConfigError, match=r"checkpoint_imatrix is unset, but llama.cpp quantizes blk\.0\.\S+ to IQ3_XXS"):
        resolve_stage_file(iq3_xs)

    whole = tmp_path / "whole.IQ2_XXS.gguf"
    importance = requantize.read_imatrix(imatrix)
    requantize.quantize_file(dense, whole, "IQ2_XXS", imatrix=importance, nthread=2)
    assert "IQ2_XXS" in tensor_types(whole).values()
    flat = tmp_path / "flat.IQ2_XXS.gguf"  # every column equally important: other bytes, so the matrix is used
    requantize.quantize_file(dense, flat, "IQ2_XXS", imatrix={n: np.ones_like(v) for n, v in importance.items()},
                             nthread=2)
    weights = {f: {t.name: bytes(t.data) for t in gguf.GGUFReader(f).tensors} for f in (whole, flat)}
    assert weights[whole]["blk.0.attn_q.weight"] != weights[flat]["blk.0.attn_q.weight"]
    ref_rows, ref_tokens = reference_run(whole, PROMPT, N_TOKENS)
    configs = split_configs(dense, SPLIT, slice_cache, kv_unified=False, checkpoint_quantization="IQ2_XXS",
                            checkpoint_imatrix=str(imatrix), checkpoint_imatrix_sha256=sha)
    rows, tokens = split_run(configs, PROMPT, N_TOKENS)
    diff = max_diff(rows, ref_rows)
    print(f"IQ2_XXS with the computed imatrix: max |logit diff| = {diff}")
    assert diff == 0.0 and tokens == ref_tokens


@pytest.mark.parametrize(("field", "value", "message"), [
    ("checkpoint_quantization", "Q9_K", "is not one of preserve, F16"),
    ("checkpoint_quantization", "q4_k_m", "is not one of preserve"),
    ("checkpoint_imatrix_sha256", "ab" * 32, "is set without checkpoint_imatrix"),
    ("load_mode", "artifact-slice", "needs load_mode runtime-slice"),
])
def test_a_quantization_config_that_cannot_work_is_refused_by_name(field, value, message):
    fields = dict(model_path="m.gguf", stage_id="s0", stage_index=0, layer_start=0, layer_end=2,
                  checkpoint_quantization="Q4_K_M")
    with pytest.raises(ConfigError, match=f"{field if field != 'load_mode' else 'checkpoint_quantization'}="
                                          f".*{message}"):
        StageConfig.from_dict({**fields, field: value})


def test_smollm2_q4_1_requantized_stage_by_stage_equals_it_requantized_once(smollm2, tmp_path, slice_cache):
    whole = tmp_path / "smollm2.Q4_K_M.gguf"
    requantize.quantize_file(smollm2, whole, "Q4_K_M", nthread=2)
    tokens_in = [1, 504, 3458, 282, 4649, 314]
    ref_rows, ref_tokens = reference_run(whole, tokens_in, 4)
    configs = split_configs(smollm2, [(0, 10), (10, 30)], slice_cache, kv_unified=False,
                            checkpoint_quantization="Q4_K_M")
    rows, tokens = split_run(configs, tokens_in, 4)
    diff = max_diff(rows, ref_rows)
    print(f"SmolLM2 Q4_1 -> Q4_K_M, split 0:10/10:30: max |logit diff| = {diff}")
    assert diff == 0.0 and tokens == ref_tokens


# -- from a layer package ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_package(dense, tmp_path_factory):
    """The dense model cut into a layer package (a part per layer)."""
    return write_package(dense, tmp_path_factory.mktemp("requantize-package") / "pkg", progress=False)


@pytest.mark.parametrize(("quantization", "with_imatrix"), [("Q4_K_M", False), ("Q5_K_M", False), ("IQ2_XXS", True)])
def test_stages_loaded_from_a_package_and_quantized_there_equal_the_whole_model_quantized_once(
        quantization, with_imatrix, dense, dense_package, imatrix, tmp_path):
    """Three stages, each with a cache of its own (three hosts), load their ranges from the package over
    HTTP and quantize them there: each plans from the whole model's header written from the manifest's
    tensor list and the metadata part (a sparse skeleton), and fetches nothing but the manifest, the
    metadata part and the parts of its range. The chain's logits equal the whole model quantized once."""
    settings: dict[str, object] = {}
    importance = None
    if with_imatrix:
        importance = requantize.read_imatrix(imatrix)
        settings = dict(checkpoint_imatrix=str(imatrix),
                        checkpoint_imatrix_sha256=hashlib.sha256(imatrix.read_bytes()).hexdigest())
    whole = tmp_path / f"whole.{quantization}.gguf"
    requantize.quantize_file(dense, whole, quantization, imatrix=importance, nthread=2)
    ref_rows, ref_tokens = reference_run(whole, PROMPT, N_TOKENS)

    with PackageServer(dense_package.manifest_path.parent) as server:
        configs = [cfg.replace(cache_dir=str(tmp_path / cfg.stage_id)) for cfg in split_configs(
            "", SPLIT, None, package_ref=server.url, manifest_sha256=dense_package.manifest_sha256,
            load_mode="artifact-slice", kv_unified=False, checkpoint_quantization=quantization, **settings)]
        paths = [resolve_stage_file(cfg, progress=False)[0] for cfg in configs]
        rows, tokens = split_run(configs, PROMPT, N_TOKENS)
        fetched = {cfg.stage_id: sorted(server.paths(agent=f"({cfg.stage_id})")) for cfg in configs}

    diff = max_diff(rows, ref_rows)
    print(f"{quantization} from the package, split {SPLIT}: max |logit diff| = {diff}")
    assert diff == 0.0
    assert tokens == ref_tokens
    whole_types = tensor_types(whole)
    for cfg, path in zip(configs, paths):
        assert path.parent.name == dense_package.manifest_sha256[:16] and f".{quantization}." in path.name
        held = tensor_types(path)
        for name, type_name in held.items():
            if name == "token_embd.weight" and not requantize.uses_token_embd(cfg.layer_start == 0, cfg.include_output,
                                                                             held):
                continue  # zeros in the source's type: the stage never reads them
            i = name.split(".")[1] if name.startswith("blk.") else None
            whole_name = name if i is None else name.replace(f"blk.{i}.", f"blk.{int(i) + cfg.layer_start}.", 1)
            assert type_name == whole_types[whole_name], (cfg.stage_id, name)
        layers = [f"layers-{n:03d}-{n + 1:03d}.gguf" for n in range(cfg.layer_start, cfg.layer_end)]
        own = ["embedding.gguf"] * (cfg.layer_start == 0) + ["output.gguf"] * bool(cfg.include_output)
        assert fetched[cfg.stage_id] == sorted([MANIFEST_NAME, "metadata.gguf", *layers, *own]), cfg.stage_id


def test_the_packages_skeleton_plans_as_the_whole_file_does(dense, dense_package, tmp_path):
    """What a package stage plans from: the metadata part's keys and the manifest's tensor list, the
    weights a hole; the same header as the source's, byte for byte."""
    (cfg,) = split_configs("", [(0, 6)], tmp_path, package_ref=str(dense_package.manifest_path.parent),
                           manifest_sha256=dense_package.manifest_sha256, load_mode="artifact-slice")
    skeleton = tmp_path / "skeleton.gguf"
    package_stage.write_skeleton(skeleton, package_stage.plan(cfg))
    data_offset = gguf.GGUFReader(dense).data_offset
    assert skeleton.stat().st_size == dense.stat().st_size
    assert skeleton.read_bytes()[:data_offset] == dense.read_bytes()[:data_offset]
    assert skeleton.stat().st_blocks * 512 < dense.stat().st_size // 50
    for quantization in ("Q4_K_M", "Q5_K_M"):
        assert requantize.whole_model_plan(skeleton, quantization) == requantize.whole_model_plan(dense, quantization)


def test_a_version_1_package_loads_as_it_is_but_cannot_be_quantized(dense_package, tmp_path):
    """A manifest of version 1 lists no tensors: its stages load as the package holds them, and a stage
    that asks to quantize is refused before it fetches a layer, naming the manifest's version."""
    root = tmp_path / "pkg"
    shutil.copytree(dense_package.manifest_path.parent, root)
    data = json.loads((root / MANIFEST_NAME).read_text())
    data["version"] = 1
    del data["tensors"]
    raw = (json.dumps(data, indent=1) + "\n").encode()
    (root / MANIFEST_NAME).write_bytes(raw)
    sha256 = hashlib.sha256(raw).hexdigest()

    (_, preserve) = split_configs("", [(0, 3), (3, 6)], tmp_path / "a", package_ref=str(root), manifest_sha256=sha256,
                                  load_mode="artifact-slice")
    assert resolve_stage_file(preserve, progress=False)[0].is_file()
    quantized = preserve.replace(checkpoint_quantization="Q4_K_M", cache_dir=str(tmp_path / "b"))
    with pytest.raises(ConfigError, match="stage-1: .*checkpoint_quantization=Q4_K_M needs the whole model's tensor "
                                          "list, which a version 1 manifest lacks"):
        resolve_stage_file(quantized, progress=False)
    assert not list((tmp_path / "b").glob("package-parts/*.gguf"))
