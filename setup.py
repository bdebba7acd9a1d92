"""Only the compiled parts: the hidden-state capture callback (skippy_stage/model/native/capture.c,
a plain shared library that skippy_stage.model.capture loads with ctypes) and a stage's
frame path for plain frames (skippy_stage/stage/native/frames.c, a Python module:
skippy_stage.stage._frames).

Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "skippy_stage.model._capture",
            sources=["skippy_stage/model/native/capture.c"],
            depends=["skippy_stage/model/native/capture.h"],
            extra_compile_args=["-O2", "-std=c99"],
            py_limited_api=False,
        ),
        Extension(
            "skippy_stage.stage._frames",
            sources=["skippy_stage/stage/native/frames.c"],
            depends=["skippy_stage/model/native/capture.h"],
            extra_compile_args=["-O2", "-Wall"],
            # Without it (no compiler or Python headers) every frame runs the Python path.
            optional=True,
        ),
    ],
)
