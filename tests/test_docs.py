"""Documentation that describes the product as it is: generated reference pages are current, every
config field says what it does."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from skippy_stage.config import StageConfig

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "config_reference.py"


def test_the_configuration_reference_is_what_the_config_defines():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_config_field_has_a_description_and_a_row():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import config_reference
    finally:
        sys.path.remove(str(SCRIPT.parent))
    docs = config_reference.field_docs()
    page = (ROOT / "docs" / "configuration.md").read_text()
    for f in dataclasses.fields(StageConfig):
        assert len(docs.get(f.name, "")) > 20, f"StageConfig.{f.name} has no docstring saying what it does"
        assert f"| `{f.name}` |" in page


# How the work that built the product was organised never appears in it: no working periods, their
# numbers, or what was tried when.
_PROCESS_WORDS = re.compile(r"(?i)\b(?:stops?|working[ ]periods?)\s+(?:\d+|of\b)|\buntil[ ]stop\b|\bsessions?[ ]of[ ]work\b")


def test_no_file_in_the_repository_speaks_of_the_process_that_built_it():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in files:
        path = ROOT / name
        if name.startswith("tests/fixtures/") or path.suffix in (".gz", ".so") or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _PROCESS_WORDS.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "\n".join(found)
