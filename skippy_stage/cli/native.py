"""Which compiled parts the stages started here load, and from where.

A stage runs without its compiled parts (the hidden-state capture, the frame path) and is
slower for it, not wrong: so it is easy to run the slow path without noticing. ``info`` and the
first line of ``up``/``demo`` say which are loaded. Started as its own process with the stages'
command line (:func:`skippy_stage.cli.local.stage_command`), it reports what the stages import,
which is not always what the process that starts them imports (``python -m`` from a source
checkout imports the checkout).
"""

from __future__ import annotations

import importlib
import json
import subprocess
from pathlib import Path

import skippy_stage


def native_paths() -> dict[str, object]:
    """The package's directory, and each compiled part: ``loaded`` and its file, or why not."""
    package = Path(skippy_stage.__file__).resolve().parent
    report: dict[str, object] = {"package": str(package)}
    capture = sorted((package / "model").glob("_capture*.so"))
    report["capture"] = ({"loaded": True, "file": capture[0].name} if capture else
                         {"loaded": False, "why": f"no compiled _capture in {package / 'model'}"})
    try:
        frames = importlib.import_module("skippy_stage.stage._frames")
    except ImportError as exc:
        report["frames"] = {"loaded": False, "why": f"skippy_stage.stage._frames: {exc}"}
    else:
        report["frames"] = {"loaded": True, "file": Path(str(frames.__file__)).name}
    return report


def summary(report: dict[str, object]) -> str:
    """One line: 'native capture and frame path loaded (from DIR)', or what is missing."""
    missing = [name for name in ("capture", "frames") if not report[name]["loaded"]]  # type: ignore[index]
    if not missing:
        return f"native capture and frame path loaded (package {report['package']})"
    why = "; ".join(str(report[name]["why"]) for name in missing)  # type: ignore[index]
    return (f"SLOW PATH: {' and '.join(missing)} not compiled in {report['package']} ({why}); "
            f"reinstall with a C compiler (pip install .)")


def probe() -> dict[str, object]:
    """:func:`native_paths` as a stage started here sees it (same interpreter, same path rules)."""
    from skippy_stage.cli.local import child_python

    done = subprocess.run(child_python("import json; from skippy_stage.cli.native import native_paths; "
                                       "print(json.dumps(native_paths()))"),
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        return {"package": "?", "capture": {"loaded": False, "why": done.stderr.strip()[-300:]},
                "frames": {"loaded": False, "why": "the probe failed"}}
    return json.loads(done.stdout)
