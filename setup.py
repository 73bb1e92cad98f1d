"""The optional C helper of the submit path (`kvtier.engine._fast`, see engine/fast.py); the
rest of the package is configured in pyproject.toml. Without a C compiler the build skips it
(optional=True) and kvtier runs those steps in numpy and ctypes."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.engine._fast", ["src/kvtier/engine/_fast.c"], optional=True, extra_compile_args=["-O2"]
        )
    ]
)
