"""The optional C helpers of the submit path (`kvtier._fast`, see
engine/fastpath/fast.py, and `kvtier._slab`, see slab.py); the rest of the package is configured
in pyproject.toml. Without a C compiler the build skips them (optional=True) and kvtier runs those
steps in Python, numpy and ctypes."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier._fast",
            ["src/kvtier/_fast.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension("kvtier._slab", ["src/kvtier/_slab.c"], optional=True, extra_compile_args=["-O2"]),
    ]
)
