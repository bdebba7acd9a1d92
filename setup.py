"""Only the compiled parts: the hidden-state capture callback (skippy_stage/model/native/capture.c,
a plain shared library that skippy_stage.model.capture loads with ctypes) and a stage's
frame path for plain frames (skippy_stage/stage/native/*.c around frames.h, a Python module:
skippy_stage.stage._frames).

Everything else is in pyproject.toml.

Building with sanitizers: ``SKIPPY_SANITIZE=1`` compiles and links both with AddressSanitizer and
UndefinedBehaviorSanitizer (``-fsanitize=address,undefined -fno-omit-frame-pointer -g -O1``).
The interpreter itself is not built with ASan, so the ASan runtime must be preloaded, and leak
detection turned off (the interpreter's own allocations would read as leaks at exit); a UBSan
finding stops the process. Build in a scratch copy, never over the normal build (``--force``: only
the flags changed), and point the tests (and the processes they start) at it::

    cp -r . /tmp/sanbuild && cd /tmp/sanbuild && rm -rf build
    SKIPPY_SANITIZE=1 python setup.py build_ext --inplace --force
    LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \\
        UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 PYTHONPATH=$PWD \\
        python -m pytest -q -s -p no:cacheprovider tests/stage/test_native_frames.py

(docs/architecture.md, "Building with sanitizers".)
"""

import os

from setuptools import Extension, setup

SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g", "-O1"]
sanitized = os.environ.get("SKIPPY_SANITIZE") == "1"


def flags(*compile_args: str) -> dict[str, list[str]]:
    """An extension's compile and link flags: ``compile_args`` with -O2, or the sanitizers' flags."""
    if sanitized:
        return {"extra_compile_args": [*compile_args, *SANITIZE], "extra_link_args": SANITIZE}
    return {"extra_compile_args": [*compile_args, "-O2"]}


FRAMES = "skippy_stage/stage/native/"

setup(
    ext_modules=[
        Extension(
            "skippy_stage.model._capture",
            sources=["skippy_stage/model/native/capture.c"],
            depends=["skippy_stage/model/native/capture.h"],
            py_limited_api=False,
            **flags("-std=c99"),
        ),
        Extension(
            "skippy_stage.stage._frames",
            sources=[FRAMES + name
                     for name in ("module.c", "wire.c", "sync.c", "reader.c", "lanes.c", "path.c", "lone.c")],
            depends=[FRAMES + "frames.h", "skippy_stage/model/native/capture.h"],
            # One module from several files: only PyInit__frames leaves it (their shared sk_* stay inside).
            **flags("-Wall", "-fvisibility=hidden"),
            # Without it (no compiler or Python headers) every frame runs the Python path.
            optional=True,
        ),
    ],
)
