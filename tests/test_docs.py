"""Documentation that describes the product as it is: generated reference pages are current, every
config field says what it does."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from skippy_stage.config import StageConfig

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "config_reference.py"


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
