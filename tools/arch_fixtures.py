#!/usr/bin/env python3
"""Build the architecture fixtures from the pinned llama.cpp and prove every split of them.

    python tools/arch_fixtures.py            # C++ build, describe, prove (~15 min on 2 cores)
    python tools/arch_fixtures.py --prove    # only prove again, from the committed description
    python tools/arch_fixtures.py --as-saved # describe the test's models as it saves them (no deepening)

1. Fetch the sdist of the pinned llama-cpp-python from PyPI and take its vendored llama.cpp.
2. Deepen ``tests/test-llama-archs.cpp`` to at least 6 layers (8 for llama4, whose no-rope
   step is 4): its per-layer metadata arrays are built in loops over ``n_layer``, so the
   test's own code extends them and its own initialiser gives every block fresh values.
3. Build its ``test-llama-archs`` target with CMake and let it save every architecture
   (``-o DIR``): ``<arch>-dense.gguf`` and ``<arch>-moe.gguf``.
4. Describe each file (metadata with GGUF types, tensor names, shapes, types) into
   ``tests/fixtures/archs.jsonl.gz``; the repository keeps that, not the weights: the tests
   regenerate the weights from a seed (``skippy_stage.model.synthetic``) in seconds.
5. Prove: regenerate each fixture, ``verify`` a 3-way split with a one-layer stage, and
   write the verdicts to ``skippy_stage/model/proofs.py``, the table ``slicing`` accepts
   architectures from. The packaged SmolLM2 (llama) and Gemma-3 join as real models.

``--as-saved`` builds the unmodified test and describes its files, as llama.cpp saves them (2
layers for most architectures, empty arrays included), into ``tests/fixtures/archs-as-saved.jsonl.gz``:
the material of the test that every GGUF llama.cpp writes slices, and verifies or is refused by name.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pprint
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy_stage.errors import ConfigError, SkippyError  # noqa: E402
from skippy_stage.model import layer_rules, synthetic  # noqa: E402
from skippy_stage.model.verify import verify  # noqa: E402

DESCRIPTION = ROOT / "tests" / "fixtures" / "archs.jsonl.gz"
AS_SAVED = ROOT / "tests" / "fixtures" / "archs-as-saved.jsonl.gz"
UNBUILT = ROOT / "tests" / "fixtures" / "archs-unbuilt.json"  # architectures the C++ test cannot build
PROOFS = ROOT / "skippy_stage" / "model" / "proofs.py"
SEED = 42
PROVE_TIMEOUT_S = 600
MIN_LAYERS = 6
DEEPEN_ANCHOR = "    uint32_t n_head_kv = n_head;\n"
# Hybrids: the 2-layer test marks layer 1 recurrent; deepened, every odd layer is, so a split
# can give each stage both kinds of layer (llama.cpp needs both in a hybrid's stage).
HYBRID_ANCHOR = "n_head_per_layer.push_back(il == 1 ? 0 : n_head);"
HYBRID = "n_head_per_layer.push_back(il % 2 == 1 ? 0 : n_head);"
DEEPEN = ("    // skippy-stage: at least 6 blocks, so a 3-way split can have a one-layer stage\n"
          f"    if (n_layer < {MIN_LAYERS}) {{ n_layer = arch == LLM_ARCH_LLAMA4 ? 8 : {MIN_LAYERS}; }}\n")


def default_split(n: int) -> list[tuple[int, int]]:
    """Three stages, the middle one a single layer."""
    a = max(1, n // 3)
    return [(0, a), (a, a + 1), (a + 1, n)]


def candidate_splits(n: int) -> list[list[tuple[int, int]]]:
    """The default first, then every other 3-way split with a one-layer stage, any 3-way, any 2-way."""
    one_layer = [[(0, a), (a, a + 1), (a + 1, n)] for a in range(1, n - 1)]
    three = [[(0, a), (a, b), (b, n)] for a in range(1, n - 1) for b in range(a + 1, n)]
    two = [[(0, a), (a, n)] for a in range(1, n)]
    out = [default_split(n)]
    for split in one_layer + three + two:
        if split not in out:
            out.append(split)
    return out


def pick_split(spec: synthetic.ModelSpec) -> list[tuple[int, int]]:
    """The first candidate llama.cpp can run: some architectures constrain where a boundary may go."""
    kv = {k: v for k, _, _, v in spec.metadata}
    reasons = []
    for split in candidate_splits(spec.block_count):
        try:
            layer_rules.check_split(kv, spec.architecture, split)
            return split
        except ConfigError as exc:
            reasons.append(str(exc))
    raise ConfigError(f"no split of the {spec.block_count}-layer fixture is allowed: {reasons[0]}")


def fetch_llama_cpp(work: Path, sdist: Path | None, *, deepen: bool = True) -> Path:
    version = importlib.metadata.version("llama-cpp-python")
    if sdist is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={version}", "-d", str(work)], check=True)
        sdist = next(work.glob(f"llama_cpp_python-{version}.tar.gz"))
    src = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not src.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
    test = src / "tests" / "test-llama-archs.cpp"
    text = test.read_text()
    if not deepen:
        if DEEPEN in text or HYBRID in text:
            raise SystemExit(f"{test} is deepened: give --as-saved a work directory of its own")
        return src
    if DEEPEN not in text:
        if DEEPEN_ANCHOR not in text:
            raise SystemExit(f"{test}: the deepening anchor {DEEPEN_ANCHOR!r} is gone; update this script")
        text = text.replace(DEEPEN_ANCHOR, DEEPEN + DEEPEN_ANCHOR, 1)
    if HYBRID not in text:
        if HYBRID_ANCHOR not in text:
            raise SystemExit(f"{test}: the hybrid anchor {HYBRID_ANCHOR!r} is gone; update this script")
        text = text.replace(HYBRID_ANCHOR, HYBRID, 1)
    test.write_text(text)
    return src


def build(src: Path, jobs: int) -> Path:
    out = src / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_BUILD_TESTS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TOOLS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(out), "--target", "test-llama-archs", "-j", str(jobs)], check=True)
    return next(out.rglob("test-llama-archs"))


def architectures(src: Path) -> list[str]:
    """The architecture names llama.cpp knows (``LLM_ARCH_NAMES`` in src/llama-arch.cpp)."""
    text = (src / "src" / "llama-arch.cpp").read_text()
    return [name for name in re.findall(r'\{\s*LLM_ARCH_\w+,\s*"([^"]+)"\s*\}', text) if name != "(unknown)"]


def save_fixtures(binary: Path, src: Path, dest: Path) -> tuple[list[Path], dict[str, str]]:
    """Every fixture the test saves, and the architectures it fails to build, with its last error.

    One run per architecture: the test stops at the first one it cannot build."""
    dest.mkdir(parents=True, exist_ok=True)
    failed: dict[str, str] = {}
    for arch in architectures(src):
        proc = subprocess.run([str(binary), "-o", str(dest), "-s", str(SEED), "-a", arch], capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line]
            failed[arch] = errors[-1].split(": ", 1)[-1] if errors else f"exit {proc.returncode}"
            print(f"test-llama-archs cannot build {arch}: {failed[arch]}", file=sys.stderr)
    return sorted(dest.glob("*.gguf")), failed


def describe_all(files: list[Path]) -> list[synthetic.ModelSpec]:
    specs = []
    for f in files:
        try:
            specs.append(synthetic.describe(f))
        except ValueError as exc:
            print(f"skip {f.name}: {exc}", file=sys.stderr)
    return specs


def prove(spec: synthetic.ModelSpec, scratch: Path) -> dict[str, object]:
    row: dict[str, object] = {"fixture": spec.stem, "moe": spec.moe, "layers": spec.block_count,
                              "split": "/".join(f"{a}:{b}" for a, b in default_split(spec.block_count))}
    try:
        split = pick_split(spec)
        row["split"] = "/".join(f"{a}:{b}" for a, b in split)
        path = synthetic.write_model(spec, scratch / f"{spec.stem}.gguf", seed=SEED)
        report = verify(path, split, tokens=6, cache_dir=scratch / "slices")
        path.unlink()
    except SkippyError as exc:
        row.update(max_abs_diff=None, exact=False, reason=str(exc))
        return row
    except Exception as exc:  # noqa: BLE001 - a fixture llama.cpp cannot run is a verdict, not a crash
        row.update(max_abs_diff=None, exact=False, reason=f"{type(exc).__name__}: {exc}")
        return row
    diffs = [b.max_abs_diff for b in report.boundaries] + [report.logits_max_abs_diff, report.independent_max_abs_diff]
    row.update(max_abs_diff=max(diffs), exact=report.exact)
    if not report.exact:
        worst = ", ".join(f"layer {b.layer}: {b.max_abs_diff:.3g}" for b in report.boundaries)
        row["reason"] = (f"split {row['split']} of the fixture is not exact (hidden-state diff at boundaries {worst}; "
                         f"logits {report.logits_max_abs_diff:.3g}, vs llama-cpp-python "
                         f"{report.independent_max_abs_diff:.3g})")
        cause = layer_rules.UNGUARDED_INPUT.get(spec.architecture)
        if cause:
            row["reason"] += f": {cause}"
    return row


def run_proofs(specs: dict[str, synthetic.ModelSpec], only: str | None) -> list[dict[str, object]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="skippy-archs-") as scratch:
        for stem, spec in sorted(specs.items()):
            if only and not re.search(only, stem):
                continue
            # One process per fixture: an architecture llama.cpp aborts on must not end the run.
            try:
                proc = subprocess.run([sys.executable, __file__, "--prove-one", stem, "--scratch", scratch],
                                      capture_output=True, text=True, timeout=PROVE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc = subprocess.CompletedProcess([], -1, "", f"no verdict within {PROVE_TIMEOUT_S} s")
            if proc.returncode == 0 and proc.stdout.strip():
                row = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                row = {"fixture": stem, "moe": spec.moe, "layers": spec.block_count,
                       "split": "/".join(f"{a}:{b}" for a, b in default_split(spec.block_count)),
                       "max_abs_diff": None, "exact": False,
                       "reason": f"llama.cpp stopped the process (exit {proc.returncode}): {tail[:200]}"}
            row["architecture"] = spec.architecture
            print(f"{stem:32} {'exact' if row['exact'] else 'NOT exact':10} {row.get('reason', '')[:100]}", flush=True)
            rows.append(row)
    return rows


REAL_MODELS = {"llama": [(0, 10), (10, 11), (11, 30)], "gemma3": [(0, 5), (5, 11), (11, 18)]}


def real_model_row(arch: str) -> dict[str, object]:
    from skippy_stage.model.packaged import gemma3_path, smollm2_path

    path = Path(smollm2_path() if arch == "llama" else gemma3_path())
    report = verify(path, REAL_MODELS[arch], tokens=8)
    return {"architecture": arch, "fixture": path.name, "moe": False, "layers": report.block_count,
            "split": report.split, "exact": report.exact,
            "max_abs_diff": max([b.max_abs_diff for b in report.boundaries]
                                + [report.logits_max_abs_diff, report.independent_max_abs_diff])}


def real_model_rows() -> list[dict[str, object]]:
    """The packaged real models, each proven in a process of its own like the fixtures."""
    rows = []
    for arch in REAL_MODELS:
        proc = subprocess.run([sys.executable, __file__, "--prove-real", arch], capture_output=True, text=True,
                              timeout=PROVE_TIMEOUT_S)
        if proc.returncode != 0 or not proc.stdout.strip():
            raise SystemExit(f"the real {arch} model could not be proven: {proc.stderr[-2000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


def unbuilt_rows(unbuilt: dict[str, str]) -> list[dict[str, object]]:
    """Architectures test-llama-archs cannot build: refused, with its error, not silently absent."""
    return [{"architecture": arch, "fixture": f"{arch} (not built)", "moe": False, "layers": 0, "split": "–",
             "max_abs_diff": None, "exact": False, "reason": f"test-llama-archs cannot build a fixture: {error}"}
            for arch, error in sorted(unbuilt.items())]


def with_variants(specs: list[synthetic.ModelSpec]) -> list[synthetic.ModelSpec]:
    """Fixtures the test does not write but real models have: Qwen3-VL's deepstack layers (its
    text models carry ``n_deepstack_layers = 3``, which widens the input llama.cpp expects)."""
    out = list(specs)
    stems = {s.stem for s in specs}
    for s in specs:
        key = f"{s.architecture}.n_deepstack_layers"
        if (s.architecture in ("qwen3vl", "qwen3vlmoe") and "deepstack" not in s.stem
                and any(k == key for k, *_ in s.metadata) and s.stem.replace("-", "-deepstack-", 1) not in stems):
            metadata = tuple((k, t, sub, 3 if k == key else v) for k, t, sub, v in s.metadata)
            out.append(synthetic.ModelSpec(s.stem.replace("-", "-deepstack-", 1), s.architecture, s.moe,
                                           metadata, s.tensors))
    return out


def write_table(rows: list[dict[str, object]]) -> None:
    by_arch: dict[str, list[dict[str, object]]] = {}
    for row in rows:
        by_arch.setdefault(str(row["architecture"]), []).append(row)
    version = importlib.metadata.version("llama-cpp-python")
    body = pprint.pformat({a: sorted(v, key=lambda r: str(r["fixture"])) for a, v in sorted(by_arch.items())},
                          width=120, sort_dicts=True)
    PROOFS.write_text(
        '"""Which architectures a split is proven exact for: generated by tools/arch_fixtures.py, do not edit.\n\n'
        "Each row is one ``skippy-stage verify`` run: a fixture of llama.cpp's test-llama-archs (random weights,\n"
        "deepened to 6+ layers) or a packaged real model, split in three with a one-layer stage. An architecture\n"
        "is accepted when every one of its rows is exact: its logits bit-identical to llama-cpp-python's ``Llama`` on\n"
        "the unsplit model and to this project's runtime on it, its boundary hidden states to the latter's.\n"
        '"""\n\n'
        f"LLAMA_CPP_PYTHON = {version!r}\n\n"
        f"PROOFS: dict[str, list[dict[str, object]]] = {body}\n"
    )


ARCHS_PAGE = ROOT / "docs" / "architectures.md"  # its archs markers hold the table


def write_readme_table(rows: list[dict[str, object]]) -> None:
    """The table between docs/architectures.md's archs markers: one row per proof."""
    lines = ["| architecture | dense/MoE | layers | split tested | max \\|diff\\| | verdict |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (str(r["architecture"]), str(r["fixture"]))):
        diff = "–" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:g}"
        verdict = "exact" if r["exact"] else "refused: " + str(r.get("reason", "not exact")).replace("|", "/")
        lines.append(f"| {r['architecture']} | {'MoE' if r['moe'] else 'dense'} | {r['layers']} | {r['split']} | "
                     f"{diff} | {verdict} |")
    text = ARCHS_PAGE.read_text()
    begin, end = "<!-- archs:begin -->\n", "<!-- archs:end -->"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    ARCHS_PAGE.write_text(head + begin + "\n".join(lines) + "\n" + end + tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prove", action="store_true", help="skip the C++ build: prove from the committed description")
    parser.add_argument("--only", help="regex of fixture stems to prove (the table keeps the other rows)")
    parser.add_argument("--sdist", type=Path, help="a llama-cpp-python sdist already downloaded")
    parser.add_argument("--as-saved", action="store_true",
                        help="describe the unmodified test's models into tests/fixtures/archs-as-saved.jsonl.gz")
    parser.add_argument("--work", type=Path, help="where the sdist is unpacked and built (default: in the temp dir)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--prove-one", help=argparse.SUPPRESS)
    parser.add_argument("--prove-real", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.work is None:
        args.work = Path(tempfile.gettempdir()) / ("skippy-llama-cpp-as-saved" if args.as_saved else "skippy-llama-cpp")
    if args.as_saved:
        args.work.mkdir(parents=True, exist_ok=True)
        src = fetch_llama_cpp(args.work, args.sdist, deepen=False)
        files, _ = save_fixtures(build(src, args.jobs), src, args.work / "fixtures")
        synthetic.dump_specs(describe_all(files), AS_SAVED)
        print(f"described {len(files)} models as saved into {AS_SAVED} ({AS_SAVED.stat().st_size // 1024} KiB); "
              f"measure them with: python -m pytest -q -rA tests/model/test_architectures.py -k as_saved")
        return 0
    if args.prove_real:
        print(json.dumps(real_model_row(args.prove_real)))
        return 0
    if args.prove_one:
        spec = synthetic.load_specs(DESCRIPTION)[args.prove_one]
        print(json.dumps(prove(spec, args.scratch)))
        return 0
    if not args.prove:
        args.work.mkdir(parents=True, exist_ok=True)
        src = fetch_llama_cpp(args.work, args.sdist)
        binary = build(src, args.jobs)
        files, unbuilt = save_fixtures(binary, src, args.work / "fixtures")
        synthetic.dump_specs(with_variants(describe_all(files)), DESCRIPTION)
        UNBUILT.write_text(json.dumps(unbuilt, indent=1, sort_keys=True) + "\n")
        print(f"described {len(files)} fixtures into {DESCRIPTION} ({DESCRIPTION.stat().st_size // 1024} KiB)")
    specs = synthetic.load_specs(DESCRIPTION)
    rows = run_proofs(specs, args.only)
    if args.only:
        from skippy_stage.model import proofs

        kept = [r for v in proofs.PROOFS.values() for r in v if not re.search(args.only, str(r["fixture"]))
                and str(r["fixture"]) in specs]
        rows = kept + rows
    unbuilt = json.loads(UNBUILT.read_text()) if UNBUILT.exists() else {}
    rows = rows + unbuilt_rows(unbuilt) + real_model_rows()
    write_table(rows)
    write_readme_table(rows)
    exact = sorted({str(r["architecture"]) for r in rows if r["exact"]})
    print(f"{len(exact)} architectures with an exact fixture; table in {PROOFS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
