"""The developer tools in ``tools/`` still run: each one briefly, for real, on the packaged model,
checked by what it prints (never its figures: machines are noisy). tools/README.md names every
tool there. ``config_reference`` is run by tests/test_docs.py."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from skippy_stage.model import proofs

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
NUMBER = r"-?[\d.]+"


def run_tool(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, str(TOOLS / f"{name}.py"), *args], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tools_readme_has_one_line_for_every_tool_there():
    listed = re.findall(r"^\| `(\w+\.py)` \| \S", (TOOLS / "README.md").read_text(), re.M)
    assert sorted(listed) == sorted(path.name for path in TOOLS.glob("*.py"))


def test_arch_fixtures_proves_a_fixture_as_the_committed_table_says(tmp_path):
    run = run_tool("arch_fixtures", "--prove-one", "llama-dense", "--scratch", str(tmp_path))
    row = json.loads(run.stdout.strip().splitlines()[-1])
    (committed,) = [r for r in proofs.PROOFS["llama"] if r["fixture"] == "llama-dense"]
    assert row == {k: v for k, v in committed.items() if k != "architecture"}


def test_arch_fixtures_writes_the_committed_proofs_and_architectures_table_from_their_rows(tmp_path, monkeypatch):
    tool = load_tool("arch_fixtures")
    monkeypatch.setattr(tool, "PROOFS", tmp_path / "proofs.py")
    monkeypatch.setattr(tool, "ARCHS_PAGE", tmp_path / "architectures.md")
    shutil.copy(ROOT / "docs" / "architectures.md", tool.ARCHS_PAGE)
    rows = [row for arch_rows in proofs.PROOFS.values() for row in arch_rows]

    tool.write_table(rows)
    tool.write_readme_table(rows)

    assert tool.PROOFS.read_text() == (ROOT / "skippy_stage" / "model" / "proofs.py").read_text()
    assert tool.ARCHS_PAGE.read_text() == (ROOT / "docs" / "architectures.md").read_text()


def test_frame_profile_times_the_frame_path_of_the_head_an_inner_and_the_final_stage():
    run = run_tool("frame_profile", "--frames", "5")
    rows = re.findall(rf"^(head|inner|final) \(\d+:\d+\)\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})$",
                      run.stdout, re.M)
    assert [r[0] for r in rows] == ["head", "inner", "final"], run.stdout
    for _, total, decode, rest, _ in rows:
        assert float(total) > 0 and float(decode) > 0
        assert abs(float(total) - float(decode) - float(rest)) <= 1, "the rest is the frame's time beside llama_decode"


def test_thread_cpu_prints_every_threads_cpu_a_token_for_the_unsplit_model_and_each_pipeline():
    run = run_tool("thread_cpu", "--rounds", "1", "--tokens", "4")
    sections = re.findall(rf"^== (\w+): {NUMBER} ms/token \({NUMBER} of the unsplit model\)$", run.stdout, re.M)
    assert sections == ["single", "1", "2", "3"], run.stdout
    assert len(re.findall(r"^  stage \d: +\d+ us CPU a token$", run.stdout, re.M)) == 1 + 2 + 3
    assert re.search(r"^    omp-0 +cpu +\d+ us", run.stdout, re.M), "the decode's own threads are named"
    assert len(re.findall(rf"^  all: \d+ us CPU a token = {NUMBER} cores busy$", run.stdout, re.M)) == 4


def perf_can_record() -> bool:
    if shutil.which("perf") is None:
        return False
    return subprocess.run(["perf", "sched", "record", "-o", "/dev/null", "--", "true"], capture_output=True,
                          timeout=60).returncode == 0


@pytest.mark.skipif(not perf_can_record(), reason="core_occupancy needs perf sched record (linux-perf, and the right)")
def test_core_occupancy_says_who_held_each_core_and_in_what_order():
    run = run_tool("core_occupancy", "--stages", "2", "--seconds", "0.3", "--timeline", "5")
    assert re.search(rf"^== 2 stage\(s\), {NUMBER} ms/token \(client view\)$", run.stdout, re.M), run.stdout
    cores = re.findall(r"^  core (\d+): (.*)$", run.stdout, re.M)
    assert cores and all(re.search(r"\b(S[01]|s[01]|c|\.|o|\?) [\d.]+ %", held) for _, held in cores), run.stdout
    assert re.search(r"S[01]", run.stdout), "a stage's OpenMP threads held a core"
    assert "== 5 ms of the recording" in run.stdout
