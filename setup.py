"""Builds the C kernels (kernels/csrc: paged attention, small-M linear, RMSNorm, RoPE, the fused
decode step; module.c holds the method table) as nanoserve.kernels._C at install time. The install
fails if they do not build.

-march=native tunes the kernels for the building machine (right for `pip install -e .`); set
NANOSERVE_MARCH (e.g. x86-64-v3) to build a module that runs on other machines.
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

MARCH = os.environ.get("NANOSERVE_MARCH", "native")


class BuildExt(build_ext):
    """Always recompiles, so a build for one -march never reuses objects built for another."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.force = True


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "nanoserve.kernels._C",
            sources=[
                "kernels/csrc/paged_attention.c",
                "kernels/csrc/linear.c",
                "kernels/csrc/norm_rope.c",
                "kernels/csrc/decode_step.c",
                "kernels/csrc/module.c",
            ],
            depends=["kernels/csrc/nanoserve.h"],
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
