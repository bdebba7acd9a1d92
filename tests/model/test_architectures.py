"""Every accepted architecture is accepted because a split of it was proven exact.

The fixtures are llama.cpp's own test models (tests/test-llama-archs.cpp of the pinned
source, deepened to 6+ layers): the repository keeps their description
(tests/fixtures/archs.jsonl.gz) and regenerates the random weights here. Each accepted
fixture is split in three with a one-layer stage, and in two at every boundary its layer rules
allow, and run through ``verify``: the split's logits must be bit-identical (max |diff| == 0.0)
to llama-cpp-python's ``Llama(logits_all=True)`` on the unsplit fixture, fed the same tokens in
the same batches, and to this project's runtime on it (whose residual stream at each boundary
the split's hidden states must equal too). The table in ``skippy_stage.model.proofs`` must say
what these runs say.

The same test's models as it saves them (2 layers for most, not deepened; their description is
tests/fixtures/archs-as-saved.jsonl.gz) must each slice and verify exact, or be refused by name:
a user's first GGUF is as likely to look like them as like the deepened ones.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from skippy_stage.errors import ConfigError, UnsupportedModelError
from skippy_stage.model import layer_rules, proofs, synthetic
from skippy_stage.model.slicing import accepted_architectures, check_architecture
from skippy_stage.model.verify import verify, verify_splits

DESCRIPTION = Path(__file__).resolve().parent.parent / "fixtures" / "archs.jsonl.gz"
SPECS = synthetic.load_specs(DESCRIPTION)
ROWS = {str(r["fixture"]): r for rows in proofs.PROOFS.values() for r in rows if str(r["fixture"]) in SPECS}
EXACT = sorted(stem for stem, r in ROWS.items() if r["exact"])
NOT_EXACT = sorted(stem for stem, r in ROWS.items() if not r["exact"] and r.get("max_abs_diff") is not None)


def proven_split(stem: str) -> list[tuple[int, int]]:
    """The split the table's row was proven on (3-way with a one-layer stage where the architecture allows)."""
    return [tuple(int(x) for x in part.split(":")) for part in str(ROWS[stem]["split"]).split("/")]


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("arch-fixtures")


def fixture_model(stem: str, directory: Path) -> Path:
    path = directory / f"{stem}.gguf"
    if not path.exists():
        synthetic.write_model(SPECS[stem], path, seed=42)
    return path


def test_the_table_proves_at_least_25_architectures_with_4_moe_families():
    accepted = accepted_architectures()
    moe = {str(r["architecture"]) for stem, r in ROWS.items() if r["exact"] and r["moe"]} & set(accepted)
    print(f"{len(accepted)} accepted, {len(moe)} with a MoE proof: {sorted(accepted)}")
    assert len(accepted) >= 25
    assert len(moe) >= 4
    assert {"llama", "gemma3"} <= set(accepted)


@pytest.mark.parametrize("stem", EXACT)
def test_a_three_way_split_with_a_one_layer_stage_is_bit_exact(stem, tmp_path):
    """The split of the table's row (3-way with a one-layer stage wherever the architecture allows one)."""
    spec = SPECS[stem]
    model = synthetic.write_model(spec, tmp_path / f"{stem}.gguf", seed=42)
    report = verify(model, proven_split(stem), tokens=6)  # slices in a scratch directory, removed after
    model.unlink()
    print(f"{stem}: split {report.split}, boundaries {[b.max_abs_diff for b in report.boundaries]}, logits "
          f"{report.independent_max_abs_diff} vs llama-cpp-python, {report.logits_max_abs_diff} vs the runtime, "
          f"greedy {report.greedy_agree}/{report.greedy_total}")
    assert report.independent_max_abs_diff == 0.0 and report.exact
    check_architecture(spec.architecture)  # accepted outside verify too


@pytest.mark.parametrize("stem", NOT_EXACT[:3])
def test_a_refused_fixture_is_still_not_exact_and_is_refused_with_its_reason(stem, tmp_path):
    spec = SPECS[stem]
    report = verify(synthetic.write_model(spec, tmp_path / f"{stem}.gguf", seed=42), proven_split(stem), tokens=6)
    assert not report.exact
    with pytest.raises(UnsupportedModelError, match=spec.architecture):
        check_architecture(spec.architecture)


def test_the_table_was_proven_on_the_pinned_llama_cpp():
    assert proofs.LLAMA_CPP_PYTHON == importlib.metadata.version("llama-cpp-python")


def test_an_architecture_no_proof_covers_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="'made-up-arch' is refused: no skippy-stage verify run"):
        check_architecture("made-up-arch")


def test_verify_command_exits_0_only_for_an_exact_split_and_reports_json(fixture_dir):
    stem = "qwen3-dense" if "qwen3-dense" in EXACT else EXACT[0]
    model = fixture_model(stem, fixture_dir)
    n = SPECS[stem].block_count
    layers = ",".join(f"{a}:{b}" for a, b in proven_split(stem))
    proc = subprocess.run([sys.executable, "-m", "skippy_stage.cli.commands", "--log-level", "warning", "verify",
                           str(model), "--layers", layers, "--tokens", "6", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["exact"] is True and report["layers"] == layers.replace(",", "/")
    assert [b["layer"] for b in report["boundaries"]] == [b for _, b in proven_split(stem)[:-1]]
    assert report["greedy_agree"] == report["greedy_total"] >= 2

    bad = subprocess.run([sys.executable, "-m", "skippy_stage.cli.commands", "verify", str(model),
                          "--layers", f"0:2,3:{n}"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "ranges must be contiguous" in bad.stderr


@pytest.mark.skipif(not NOT_EXACT, reason="every fixture is exact")
def test_verify_command_exits_1_when_the_split_is_not_exact(fixture_dir):
    stem = NOT_EXACT[0]
    model = fixture_model(stem, fixture_dir)
    layers = ",".join(f"{a}:{b}" for a, b in proven_split(stem))
    proc = subprocess.run([sys.executable, "-m", "skippy_stage.cli.commands", "--log-level", "warning", "verify",
                           str(model), "--layers", layers, "--tokens", "6"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "NOT exact" in proc.stdout


@pytest.mark.parametrize("stem", EXACT)
def test_every_allowed_two_way_split_is_bit_exact(stem, tmp_path):
    """Every two-way split the layer rules allow, all of them (no sampling), in the default run.

    What keeps it affordable: the fixture's unsplit references (this project's runtime and
    llama-cpp-python's ``Llama``) load and run once for all its splits (``verify_splits``); only
    each split's two stages are sliced and loaded per split.
    """
    spec = SPECS[stem]
    model = synthetic.write_model(spec, tmp_path / f"{stem}.gguf", seed=42)
    kv = {k: v for k, _, _, v in spec.metadata}
    splits = []
    for b in range(1, spec.block_count):
        split = [(0, b), (b, spec.block_count)]
        try:
            layer_rules.check_split(kv, spec.architecture, split)
        except ConfigError:
            continue  # refused before llama.cpp sees it: test_layer_rules pins why
        splits.append(split)
    assert splits
    for report in verify_splits(model, splits, tokens=6):
        assert report.exact, (f"{stem} split {report.split}: logits {report.independent_max_abs_diff} vs "
                              f"llama-cpp-python, {report.logits_max_abs_diff} vs the runtime, boundaries "
                              f"{[b.max_abs_diff for b in report.boundaries]}")


PACKAGED = {str(r["fixture"]): r for rows in proofs.PROOFS.values() for r in rows if str(r["fixture"]).endswith(".gguf")}


@pytest.mark.parametrize("name", sorted(PACKAGED))
def test_the_packaged_models_proven_split_is_bit_exact_against_llama_cpp_python(name, slice_cache):
    """The table's rows for the real models (SmolLM2-135M, Gemma-3-270M), rerun: logits identical to
    llama-cpp-python's on the unsplit model, and boundaries to this project's runtime on it."""
    from skippy_stage.model.packaged import gemma3_path, smollm2_path

    path = next(p for p in (smollm2_path(), gemma3_path()) if Path(p).name == name)
    ranges = [tuple(int(x) for x in part.split(":")) for part in str(PACKAGED[name]["split"]).split("/")]
    report = verify(path, ranges, tokens=8, cache_dir=slice_cache)
    print(f"{name}: split {report.split}, logits vs llama-cpp-python {report.independent_max_abs_diff}, "
          f"vs the runtime {report.logits_max_abs_diff}, boundaries {[b.max_abs_diff for b in report.boundaries]}")
    assert report.independent_max_abs_diff == 0.0 and report.exact


def test_a_fixture_is_the_same_file_every_time_and_describes_back_to_its_description(tmp_path):
    spec = SPECS["llama-dense"]
    a = synthetic.write_model(spec, tmp_path / "a.gguf", seed=42)
    b = synthetic.write_model(spec, tmp_path / "b.gguf", seed=42)
    assert a.read_bytes() == b.read_bytes()
    again = synthetic.describe(a)
    assert again.tensors == spec.tensors
    assert {k: v for k, _, _, v in again.metadata} == {k: v for k, _, _, v in spec.metadata}
    assert spec.block_count >= 6


# -- the models as llama.cpp saves them -----------------------------------------------------------

AS_SAVED = synthetic.load_specs(DESCRIPTION.with_name("archs-as-saved.jsonl.gz"))


@pytest.fixture(scope="module")
def as_saved_verdicts() -> dict[str, dict[str, object]]:
    from support import as_saved

    rows = as_saved.verdicts(sorted(AS_SAVED))
    for stem, r in sorted(rows.items()):
        print(f"{stem:34} slice {r['slice']:8} {r['verdict']:8} {r.get('split', ''):9} {str(r.get('reason', ''))[:150]}")
    counts = {v: sum(r["verdict"] == v for r in rows.values()) for v in ("exact", "refused", "failed")}
    print(f"{len(rows)} models as saved: slice ok {sum(r['slice'] == 'ok' for r in rows.values())}, "
          f"verify exact {counts['exact']}, refused by name {counts['refused']}, failed {counts['failed']}")
    return rows


def test_the_as_saved_models_are_the_tests_own_with_their_empty_arrays(tmp_path):
    """The description is of the unmodified test's files: mostly 2 layers, empty arrays kept with their type."""
    assert len(AS_SAVED) >= 100
    assert sum(s.block_count == 2 for s in AS_SAVED.values()) > len(AS_SAVED) // 2
    spec = AS_SAVED["llama-dense"]
    empty = {k: sub for k, t, sub, v in spec.metadata if t == "ARRAY" and v == ()}
    assert empty.get("tokenizer.ggml.merges") == "STRING"
    reader = gguf.GGUFReader(synthetic.write_model(spec, tmp_path / "llama-dense.gguf", seed=42))
    merges = reader.get_field("tokenizer.ggml.merges")
    assert merges.contents() == [] and gguf.GGUFValueType(int(merges.parts[3][0])) == gguf.GGUFValueType.STRING


def test_every_as_saved_model_slices_and_verifies_exact_or_is_refused_by_name(as_saved_verdicts):
    """Each of test-llama-archs' models as saved: split (the first 2-way split its rules allow), sliced,
    verified against the unsplit model; or refused naming its architecture and why."""
    assert set(as_saved_verdicts) == set(AS_SAVED)
    failed = {stem: r["reason"] for stem, r in as_saved_verdicts.items() if r["verdict"] == "failed"}
    assert not failed, json.dumps(failed, indent=1)
    for stem, r in as_saved_verdicts.items():
        if r["verdict"] == "refused":
            arch = AS_SAVED[stem].architecture
            assert f"'{arch}'" in str(r["reason"]) or f"{arch} model" in str(r["reason"]), (stem, r["reason"])
        else:
            assert r["slice"] == "ok", stem
