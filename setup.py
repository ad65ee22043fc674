"""Builds the C kernels (kernels/csrc: paged attention, small-M linear, RMSNorm, RoPE, the fused
decode step, matmuls on GGUF block weights; module.c holds the method table) as
nanoserve.kernels._C at install time; an editable install (or build_ext --inplace) puts it where
package-dir maps nanoserve.kernels, kernels/python/. The install fails if they do not build.

-march=native tunes the kernels for the building machine (right for `pip install -e .`); set
NANOSERVE_MARCH (e.g. x86-64-v3) to build a module that runs on other machines. The quantized
matmul's AVX2 and AVX-512 paths are built whatever the -march (target attributes) and chosen at run
time from what the CPU reports (NANOSERVE_ISA caps the choice).
"""

import os
from concurrent.futures import ThreadPoolExecutor
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

MARCH = os.environ.get("NANOSERVE_MARCH", "native")


class BuildExt(build_ext):
    """Always recompiles, so a build for one -march never reuses objects built for another, and
    compiles an extension's sources side by side, a compiler per CPU (setuptools runs them one
    after another; the quantized kernels, a file per block format, take most of the time)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.force = True

    def build_extension(self, ext: Extension) -> None:
        compile_one = self.compiler.compile

        def compile_all(sources, *args, **kwargs):
            with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                done = pool.map(lambda source: compile_one([source], *args, **kwargs), sources)
                return [obj for objs in done for obj in objs]

        self.compiler.compile = compile_all
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_one


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "nanoserve.kernels._C",
            # Every C file of kernels/csrc: a new kernel file is built without a line here.
            sources=sorted(glob("kernels/csrc/*.c")),
            depends=sorted(glob("kernels/csrc/*.h")),
            # -std=c11 turns off FMA contraction; -ffp-contract=fast turns it back on.
            extra_compile_args=[
                "-O3",
                f"-march={MARCH}",
                "-fopenmp",
                "-std=c11",
                "-ffp-contract=fast",
            ],
            extra_link_args=["-fopenmp"],
        )
    ],
)
