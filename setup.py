"""Build configuration that pyproject.toml cannot hold: the optional C extensions of gradagg._native.

Each is optional: where no C compiler is found or a build fails, the package installs without them and every
caller takes its pure path instead (the same answers, slower; see gradagg/_native/__init__.py).
"""

from setuptools import Extension, setup

# -O3 without -ffast-math: IEEE additions in row order are the whole point (bit-identical totals);
# -ffp-contract=off keeps the compiler from fusing anything into an FMA.
FLAGS = ["-O3", "-ffp-contract=off", "-fno-strict-aliasing"]

setup(
    ext_modules=[
        Extension("gradagg._native._pqdecode", ["src/gradagg/_native/pqdecode.c"], extra_compile_args=FLAGS,
                  depends=["src/gradagg/_native/buffer.h", "src/gradagg/_native/pqformat.h"], optional=True),
        Extension("gradagg._native._ownersum", ["src/gradagg/_native/ownersum.c"], extra_compile_args=FLAGS,
                  depends=["src/gradagg/_native/ownertable.h"], optional=True),
        Extension("gradagg._native._pairtext", ["src/gradagg/_native/pairtext.c"], extra_compile_args=FLAGS,
                  optional=True),
    ]
)
