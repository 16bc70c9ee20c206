"""Build hook for the one C extension: shardrun.merge._jsonlscan, the merge's line scanner (see its source).

It is optional: where no C compiler is found the install still succeeds and the merge runs its pure-Python
path (same results, slower). Everything else is declared in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardrun.merge._jsonlscan", ["shardrun/merge/_jsonlscan.c"], optional=True, extra_compile_args=["-O2"]
        )
    ]
)
