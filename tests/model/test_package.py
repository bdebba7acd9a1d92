"""Layer packages: ``skippy-stage package`` cuts a GGUF into parts, and a stage fetches only the
parts of its layer range, checks each against the manifest, and assembles the stage file the
slicer would have cut from the whole model.

The stage files assembled from SmolLM2's package hold exactly the runtime slices' metadata and
tensors (an inner stage's token embeddings, which it never reads, are zeros of the same shape and
type), and a chain of them computes bit-identical logits to llama-cpp-python on the unsplit model.
Over HTTP each stage fetches the manifest, the metadata part and its own parts, nothing else; a
connection dropped mid-part resumes with a Range request. A wrong manifest, a changed or missing
part, an architecture no proof accepts and a range the package does not hold are refused naming
it, before any weights load.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from support.chain import Chain, split_configs
from support.packages import PackageServer
from support.reference import Reference, chain_greedy, max_diff

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError, ModelFileError, UnsupportedModelError
from skippy_stage.model import gguf_file, package_fetch, package_stage
from skippy_stage.model.package import MANIFEST_NAME, Manifest, sha256_file, write_package
from skippy_stage.model.slicing import read_model_info, stage_file
from skippy_stage.model.stage_file import resolve_stage_file

THREE = [(0, 10), (10, 20), (20, 30)]
N_TOKENS = 16


@pytest.fixture(scope="module")
def package(smollm2, tmp_path_factory):
    return write_package(smollm2, tmp_path_factory.mktemp("package") / "smollm2", progress=False)


def package_configs(ranges, ref: str, sha256: str, cache: Path, **settings: object) -> list[StageConfig]:
    """A chain's configs loading from the package (no model_path: the package is the model)."""
    return split_configs("", ranges, cache, package_ref=ref, manifest_sha256=sha256, load_mode="artifact-slice",
                         **settings)


def contents(path: Path) -> tuple[dict[str, bytes], dict[str, tuple]]:
    """A GGUF's metadata (raw typed bytes by key) and tensors (dims, type, sha256 of the bytes by name)."""
    raw = gguf_file.read_raw(path)
    return dict(raw.metadata), {t.name: (t.dims, t.ggml_type, hashlib.sha256(t.data).hexdigest()) for t in raw.tensors}


@pytest.fixture(scope="module")
def assembled(package, tmp_path_factory):
    """The stage files of 0:10/10:20/20:30 assembled from the package (loaded from its directory),
    in a cache of their own; each stage's config and file."""
    cache = tmp_path_factory.mktemp("assembled")
    configs = package_configs(THREE, str(package.manifest_path.parent), package.manifest_sha256, cache)
    return cache, [(cfg, package_stage.stage_file(cfg, progress=False)) for cfg in configs]


def rewrite_manifest(package, dest: Path, change) -> str:
    """A copy of the package in ``dest`` whose manifest ``change(dict)`` edited; its sha256."""
    shutil.copytree(package.manifest_path.parent, dest)
    data = json.loads((dest / MANIFEST_NAME).read_text())
    change(data)
    raw = (json.dumps(data, indent=1) + "\n").encode()
    (dest / MANIFEST_NAME).write_bytes(raw)
    return hashlib.sha256(raw).hexdigest()


# -- the package --------------------------------------------------------------------------------


def test_the_package_holds_every_tensor_and_key_of_the_source_once_under_its_own_name(smollm2, package):
    manifest = package.manifest
    root = package.manifest_path.parent
    assert package.manifest_sha256 == hashlib.sha256(package.manifest_path.read_bytes()).hexdigest()
    assert Manifest.from_json(package.manifest_path.read_bytes(), "test") == manifest
    assert (manifest.source_file, manifest.source_bytes) == (smollm2.name, smollm2.stat().st_size)
    assert manifest.source_sha256 == sha256_file(smollm2)
    assert (manifest.architecture, manifest.block_count) == ("llama", 30)
    assert manifest.quantization["file_type_name"] == "MOSTLY_Q4_1" and manifest.quantization["tensor_types"]["Q4_1"]
    assert manifest.tied_embeddings  # SmolLM2's output head is its embeddings: no output part
    roles = [p.role for p in manifest.parts]
    assert roles.count("metadata") == roles.count("embedding") == 1 and "output" not in roles
    assert [p.layers for p in manifest.layer_parts()] == [(i, i + 1) for i in range(30)]
    for part in manifest.parts:
        assert sha256_file(root / part.path) == part.sha256 and (root / part.path).stat().st_size == part.bytes

    source_kv, source_tensors = contents(smollm2)
    held: dict[str, tuple] = {}
    for part in manifest.parts:
        kv, tensors = contents(root / part.path)
        assert not set(held) & set(tensors)
        held.update(tensors)
        if part.role == "metadata":
            assert kv == source_kv  # every key, byte for byte, and nothing added
            assert set(tensors) == {"output_norm.weight"}
        elif part.role == "layers":
            assert {name.split(".")[1] for name in tensors} == {str(part.layers[0])}
    assert held == source_tensors
    # every tensor's info, in the source's order: what a stage quantizing its range plans from
    assert [(t.name, t.dims, int(GGMLQuantizationType[t.ggml_type])) for t in manifest.tensors] == [
        (name, dims, ggml_type) for name, (dims, ggml_type, _) in source_tensors.items()]


def test_package_on_the_command_line_prints_the_manifest_sha256(smollm2, tmp_path):
    out = tmp_path / "pkg"
    done = subprocess.run([sys.executable, "-m", "skippy_stage", "package", str(smollm2), "--out", str(out),
                           "--layers-per-part", "7"], capture_output=True, text=True, timeout=120)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == hashlib.sha256((out / MANIFEST_NAME).read_bytes()).hexdigest()
    manifest = Manifest.from_json((out / MANIFEST_NAME).read_bytes(), str(out))
    assert [p.layers for p in manifest.layer_parts()] == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 30)]
    assert [p.path for p in manifest.layer_parts()][:2] == ["layers-000-007.gguf", "layers-007-014.gguf"]
    assert "manifest_sha256" in done.stderr


# -- stage files from the package --------------------------------------------------------------------


def test_stage_files_assembled_from_the_package_are_the_slicers_own(smollm2, package, assembled, slice_cache):
    """The same metadata and tensors as the runtime slices of the whole GGUF; only the inner stage's
    token embeddings differ: zeros of the same shape and type, which llama.cpp requires and a stage
    that takes hidden states in never reads. (The final stage holds the real ones: SmolLM2's head is
    its embeddings.)"""
    _, stages = assembled
    for cfg, made in stages:
        assert made.built
        sliced = stage_file(smollm2, cfg.layer_start, cfg.layer_end, final=cfg.include_output, cache_dir=slice_cache)
        got_kv, got = contents(made.path)
        want_kv, want = contents(sliced.path)
        assert got_kv == want_kv
        if cfg.layer_start == 10:
            dims, ggml_type, _ = want.pop("token_embd.weight")
            zeros = np.zeros(package.manifest.embedding.bytes, dtype=np.uint8)
            assert got.pop("token_embd.weight") == (dims, ggml_type, hashlib.sha256(zeros).hexdigest())
        assert got == want
        assert package_stage.stage_file(cfg, progress=False).path == made.path  # cached


def test_a_chain_loaded_from_the_package_computes_exactly_what_the_unsplit_model_computes(smollm2, package, assembled):
    """The equivalence tests' proof, on stage files assembled from the package: every step's logits
    (the prompt's last row and the rows decoded after it) bit-identical to llama-cpp-python's on the
    unsplit GGUF, and the same greedy tokens. The stages name the package by a file:// URL: the
    stage files assembled from its directory are found in the cache (keyed by the manifest's sha256,
    the range and the role, whatever the URL)."""
    cache, stages = assembled
    configs = package_configs(THREE, package.manifest_path.parent.as_uri(), package.manifest_sha256, cache)
    assert [package_stage.stage_file(cfg, progress=False).path for cfg in configs] == [made.path for _, made in stages]
    chain = Chain(configs)
    (whole,) = split_configs(smollm2, [(0, 30)], None)
    reference = Reference(whole)
    try:
        prompt = reference.llm.tokenize(b"Once upon a time, in a small village by the sea,", add_bos=True)
        ref_rows, ref_tokens = reference.greedy_alone(prompt, N_TOKENS)
        rows, tokens, _ = chain_greedy(chain, {"s": prompt}, N_TOKENS)
    finally:
        reference.close()
        chain.close()
    diff = max_diff(rows["s"], ref_rows)
    print(f"package chain 0:10/10:20/20:30: max |logit diff| over {len(ref_rows)} steps = {diff}")
    assert diff == 0.0
    assert tokens["s"] == ref_tokens


# -- fetching ----------------------------------------------------------------------------------------


def test_each_stage_fetches_only_its_own_parts_over_http(package, tmp_path):
    """Three stages, each with a cache of its own (three hosts): the manifest, the metadata part and
    the parts of its range; the embedding for the head and for the final stage (tied embeddings)."""
    root = package.manifest_path.parent
    with PackageServer(root) as server:
        configs = package_configs(THREE, server.url, package.manifest_sha256, tmp_path / "unused")
        for cfg in configs:
            package_stage.fetch(package_stage.plan(cfg.replace(cache_dir=str(tmp_path / cfg.stage_id))))
        for cfg in configs:
            layers = [f"layers-{i:03d}-{i + 1:03d}.gguf" for i in range(cfg.layer_start, cfg.layer_end)]
            embedding = ["embedding.gguf"] if cfg.stage_id != "stage-1" else []
            fetched = server.paths(agent=f"({cfg.stage_id})")
            assert sorted(fetched) == sorted([MANIFEST_NAME, "metadata.gguf", *layers, *embedding]), cfg.stage_id
        assert all(r.agent.startswith("skippy-stage/") and r.range is None for r in server.requests)


def test_stages_sharing_a_host_fetch_each_part_once(package, tmp_path):
    root = package.manifest_path.parent
    with PackageServer(root) as server:
        for cfg in package_configs([(0, 15), (15, 30)], server.url, package.manifest_sha256, tmp_path):
            package_stage.fetch(package_stage.plan(cfg))
            package_stage.fetch(package_stage.plan(cfg))  # a restart: from the cache
        fetched = server.paths()
    assert sorted(fetched) == sorted([MANIFEST_NAME, "metadata.gguf", "embedding.gguf",
                                      *(f"layers-{i:03d}-{i + 1:03d}.gguf" for i in range(30))])


def test_two_stages_wanting_one_part_at_once_fetch_it_once(package, tmp_path):
    part = package.manifest.part("embedding")
    with PackageServer(package.manifest_path.parent) as server:
        source = package_fetch.open_package(server.url)
        with ThreadPoolExecutor(2) as pool:
            paths = list(pool.map(lambda _: package_fetch.fetch_part(source, part, tmp_path, progress=False), range(2)))
        assert server.paths() == [part.path]
    assert paths[0] == paths[1] and sha256_file(paths[0]) == part.sha256


def test_a_connection_dropped_mid_part_resumes_with_a_range_request(package, tmp_path):
    root = package.manifest_path.parent
    part = package.manifest.part("embedding")  # 30 MB: cut off after 15
    with PackageServer(root, drop_once=[part.path]) as server:
        source = package_fetch.open_package(server.url)
        path = package_fetch.fetch_part(source, part, tmp_path, progress=False)
        requests = [r for r in server.requests if r.path == part.path]
    assert [r.range for r in requests] == [None, f"bytes={part.bytes // 2}-"]
    assert sha256_file(path) == part.sha256
    assert not list(tmp_path.glob("package-parts/*.part"))


def test_a_fetch_left_unfinished_by_an_earlier_process_is_resumed(package, tmp_path):
    root = package.manifest_path.parent
    part = package.manifest.part("metadata")
    partial = tmp_path / "package-parts" / f"{part.sha256}.gguf.part"
    partial.parent.mkdir(parents=True)
    partial.write_bytes((root / part.path).read_bytes()[:1000])
    with PackageServer(root) as server:
        path = package_fetch.fetch_part(package_fetch.open_package(server.url), part, tmp_path, progress=False)
        assert [r.range for r in server.requests] == ["bytes=1000-"]
    assert sha256_file(path) == part.sha256


# -- refusals, before any weights load ------------------------------------------------------------------


def refusal(cfg: StageConfig, error: type[Exception]) -> str:
    """The error ``resolve_stage_file`` (what the runtime calls before llama.cpp loads anything)
    raises for ``cfg``; and no stage file was written."""
    with pytest.raises(error) as info:
        resolve_stage_file(cfg, progress=False)
    assert not list(Path(cfg.cache_dir).glob("packages/*/*.inner.*.gguf"))
    assert not list(Path(cfg.cache_dir).glob("packages/*/*.final.*.gguf"))
    return str(info.value)


def test_a_manifest_that_does_not_match_manifest_sha256_is_refused(package, tmp_path):
    wrong = "0" * 64
    (cfg, _) = package_configs([(0, 15), (15, 30)], str(package.manifest_path.parent), wrong, tmp_path)
    message = refusal(cfg, ConfigError)
    assert f"manifest_sha256={wrong!r}" in message and package.manifest_sha256 in message and "stage-0" in message
    assert not list(tmp_path.glob("package-parts/*.gguf"))  # nothing it names was fetched


def test_a_part_whose_bytes_changed_is_refused_naming_it(package, tmp_path):
    bad = tmp_path / "pkg"
    shutil.copytree(package.manifest_path.parent, bad)
    target = bad / "layers-012-013.gguf"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    (_, cfg) = package_configs([(0, 10), (10, 30)], str(bad), package.manifest_sha256, tmp_path / "cache")
    message = refusal(cfg, ModelFileError)
    assert "layers-012-013.gguf" in message and "sha256" in message and "stage-1" in message
    part = next(p for p in package.manifest.parts if p.path == "layers-012-013.gguf")
    assert not (tmp_path / "cache" / "package-parts" / f"{part.sha256}.gguf").exists()


def test_a_missing_part_is_refused_naming_it(package, tmp_path):
    root = package.manifest_path.parent
    with PackageServer(root) as server:
        server.root = tmp_path / "pkg"
        shutil.copytree(root, server.root)
        (server.root / "layers-025-026.gguf").unlink()
        (_, cfg) = package_configs([(0, 20), (20, 30)], server.url, package.manifest_sha256, tmp_path / "cache")
        message = refusal(cfg, ModelFileError)
    assert "layers-025-026.gguf is missing" in message and "404" in message and "stage-1" in message


@pytest.mark.parametrize(("arch", "error", "named"), [
    ("bert", UnsupportedModelError, "architecture 'bert' is refused"),
    ("qwen2", ModelFileError, "metadata.gguf holds a llama model of 30 layers, but the manifest says qwen2"),
])
def test_a_manifest_of_another_architecture_is_refused(package, tmp_path, arch, error, named):
    def change(data):
        data["architecture"] = arch

    sha256 = rewrite_manifest(package, tmp_path / "pkg", change)
    (cfg,) = package_configs([(0, 30)], str(tmp_path / "pkg"), sha256, tmp_path / "cache")
    message = refusal(cfg, error)
    assert named in message and "stage-0" in message


def test_a_range_the_package_does_not_hold_is_refused(package, tmp_path):
    def drop_layers(data):
        data["parts"] = [p for p in data["parts"] if not (p["layers"] and 12 <= p["layers"][0] < 14)]

    sha256 = rewrite_manifest(package, tmp_path / "pkg", drop_layers)
    (_, cfg, _) = package_configs(THREE, str(tmp_path / "pkg"), sha256, tmp_path / "cache")
    message = refusal(cfg, ConfigError)
    assert "no part with layers 12:14 of layer range 10:20" in message and "stage-1" in message
    assert not list((tmp_path / "cache").glob("package-parts/*.gguf"))


def test_a_range_beyond_the_model_is_refused(package, tmp_path):
    cfg = StageConfig(model_path="", stage_id="stage-9", stage_index=0, layer_start=0, layer_end=31,
                      package_ref=str(package.manifest_path.parent), manifest_sha256=package.manifest_sha256,
                      load_mode="artifact-slice", cache_dir=str(tmp_path))
    assert "layer range 0:31 is not inside the package's 30 layers" in refusal(cfg, ConfigError)


def test_a_package_stage_reads_the_models_header_from_the_package(smollm2, package, tmp_path):
    """``serve`` points model_path at the metadata part, under the source's file name: what reads the
    model's header (architecture, block count, vocabulary) reads the whole model's."""
    (cfg, _) = package_configs([(0, 15), (15, 30)], str(package.manifest_path.parent), package.manifest_sha256,
                               tmp_path)
    prepared = package_stage.prepare(cfg)
    assert Path(prepared.model_path).name == smollm2.name
    header, source = read_model_info(prepared.model_path), read_model_info(smollm2)
    assert (header.architecture, header.block_count, header.n_vocab) == ("llama", 30, source.n_vocab)
    assert header.metadata == source.metadata
