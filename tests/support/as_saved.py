"""The verdict on each of llama.cpp's test-llama-archs models as llama.cpp saves them.

For each model: regenerate it from ``tests/fixtures/archs-as-saved.jsonl.gz``, slice both
ranges of the first 2-way split its architecture's rules allow, and ``verify`` that split
against the unsplit model. The verdict is one of

* ``exact`` — both slices written and the split bit-exact;
* ``refused`` — a named refusal: the architecture (``UnsupportedModelError``), a split rule or a
  property of the model llama.cpp cannot run split (``ConfigError``), or a split that is not
  exact of an architecture the proofs table refuses, with its reason;
* ``failed`` — anything else: another exception, a split that is not exact yet accepted, or
  llama.cpp stopping the process (the parent sees no verdict).

Run as ``python -m support.as_saved STEM...`` (``tests`` on the path): one JSON line per model,
printed as soon as it is known, so a parent that sees the process stop knows which model stopped
it and starts another process for the rest.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

DESCRIPTION = Path(__file__).resolve().parent.parent / "fixtures" / "archs-as-saved.jsonl.gz"
SEED = 42
TOKENS = 6
CHILD_TIMEOUT_S = 600


def verdict(stem: str, scratch: Path) -> dict[str, object]:
    from skippy_stage.errors import ConfigError, SkippyError, UnsupportedModelError
    from skippy_stage.model import layer_rules, synthetic
    from skippy_stage.model.slicing import check_architecture, proving, write_slice
    from skippy_stage.model.verify import verify

    spec = synthetic.load_specs(DESCRIPTION)[stem]
    arch, n = spec.architecture, spec.block_count
    row: dict[str, object] = {"stem": stem, "architecture": arch, "layers": n}
    path = synthetic.write_model(spec, scratch / f"{stem}.gguf", seed=SEED)
    try:
        kv = {k: v for k, _, _, v in spec.metadata}
        split, reasons = None, ["a 1-layer model has no split"] if n < 2 else []
        for b in range(1, n):
            try:
                layer_rules.check_split(kv, arch, [(0, b), (b, n)])
            except (ConfigError, UnsupportedModelError) as exc:
                reasons.append(str(exc))
                continue
            split = [(0, b), (b, n)]
            break
        if split is None:
            return {**row, "slice": "refused", "verdict": "refused", "reason": reasons[0]}
        row["split"] = f"0:{split[0][1]}/{split[1][0]}:{n}"
        with proving():
            for a, b in split:
                write_slice(path, scratch / f"{stem}.{a}-{b}.gguf", a, b, final=b == n, progress=False)
        row["slice"] = "ok"
        report = verify(path, split, tokens=TOKENS, cache_dir=scratch / "slices")
        if report.exact:
            return {**row, "verdict": "exact"}
        try:
            check_architecture(arch)
        except UnsupportedModelError as exc:
            return {**row, "verdict": "refused", "reason": f"not exact: {exc}"}
        return {**row, "verdict": "failed", "reason": "not exact, yet the architecture is accepted"}
    except (ConfigError, UnsupportedModelError) as exc:
        return {**row, "slice": row.get("slice", "refused"), "verdict": "refused", "reason": str(exc)}
    except SkippyError as exc:
        return {**row, "slice": row.get("slice", "failed"), "verdict": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # noqa: BLE001 - a crash is a verdict here, reported with its place
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return {**row, "slice": row.get("slice", "failed"), "verdict": "failed",
                "reason": f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})"}
    finally:
        for f in scratch.glob(f"{stem}*"):
            f.unlink()


def verdicts(stems: list[str]) -> dict[str, dict[str, object]]:
    """Every stem's verdict, each model in a process that llama.cpp may stop without losing the others'."""
    out: dict[str, dict[str, object]] = {}
    todo = list(stems)
    tests_dir = str(Path(__file__).resolve().parent.parent)
    while todo:
        proc = subprocess.run([sys.executable, "-m", "support.as_saved", *todo], capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, cwd=tests_dir, env=_env(tests_dir))
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                out[str(row["stem"])] = row
        todo = [s for s in todo if s not in out]
        if todo:  # the process stopped on todo[0]
            tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            out[todo[0]] = {"stem": todo[0], "verdict": "failed", "slice": "?",
                            "reason": f"llama.cpp stopped the process (exit {proc.returncode}): {tail[:200]}"}
            todo = todo[1:]
    return out


def _env(tests_dir: str) -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tests_dir, *filter(None, [env.get("PYTHONPATH")])])
    return env


def main(stems: list[str]) -> int:
    import logging

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="skippy-as-saved-") as scratch:
        for stem in stems:
            print(json.dumps(verdict(stem, Path(scratch))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
