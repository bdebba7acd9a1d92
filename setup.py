"""Only the compiled parts: the hidden-state capture callback (skippy_stage/model/native/capture.c,
a plain shared library that skippy_stage.model.capture loads with ctypes) and the final stage's
frame path (skippy_stage/stage/native/finalframe.c, a Python module: skippy_stage.stage._finalframe).

Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "skippy_stage.model._capture",
            sources=["skippy_stage/model/native/capture.c"],
            extra_compile_args=["-O2", "-std=c99"],
            py_limited_api=False,
        ),
        Extension(
            "skippy_stage.stage._finalframe",
            sources=["skippy_stage/stage/native/finalframe.c"],
            extra_compile_args=["-O2", "-Wall"],
        ),
    ],
)
