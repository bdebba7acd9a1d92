"""Only the compiled part: the hidden-state capture callback (skippy_stage/model/native/capture.c).

Everything else is in pyproject.toml. The extension is a plain shared library that
skippy_stage.capture loads with ctypes (it defines no Python module).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "skippy_stage.model._capture",
            sources=["skippy_stage/model/native/capture.c"],
            extra_compile_args=["-O2", "-std=c99"],
            py_limited_api=False,
        )
    ],
)
