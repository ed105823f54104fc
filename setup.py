"""megacoat package. `pip install -e .` needs no compiler for CUDA: extensions are optional.

- `megacoat._data_helpers` (C++, pybind11, the system compiler): fast dataset index building.
  If it cannot be built, megacoat falls back to numpy with identical results.
- CUDA extensions in csrc/ are built only when a CUDA toolkit and a CUDA build of torch exist.
"""
import os
import sys

from setuptools import find_packages, setup


def _cpp_extensions():
    """Optional C++ extensions; any failure to configure them leaves a pure-Python install."""
    exts = []
    src = os.path.join("csrc", "data_helpers.cpp")
    if os.path.exists(src) and os.environ.get("MEGACOAT_NO_EXT") != "1":
        try:
            from pybind11.setup_helpers import Pybind11Extension

            exts.append(Pybind11Extension("megacoat._data_helpers", [src], cxx_std=17,
                                          extra_compile_args=["-O3", "-ffp-contract=off"]))
        except ImportError:
            print("megacoat: pybind11 not available, using the numpy index builder", file=sys.stderr)
    return exts


class _OptionalBuildExt:
    """build_ext that warns instead of failing: compiled helpers are accelerators, never required."""

    @staticmethod
    def make():
        from setuptools.command.build_ext import build_ext

        class OptionalBuildExt(build_ext):
            def run(self):
                try:
                    super().run()
                except Exception as e:  # noqa: BLE001 - any compiler problem must not break install
                    print(f"megacoat: optional extensions not built ({e}); pure-Python fallbacks are used",
                          file=sys.stderr)

            def build_extension(self, ext):
                try:
                    super().build_extension(ext)
                except Exception as e:  # noqa: BLE001
                    print(f"megacoat: optional extension {ext.name} not built ({e})", file=sys.stderr)

        return OptionalBuildExt


setup(
    name="megacoat",
    version="0.1.0",
    description="Megatron-style GPT pretraining with COAT FP8 training and SDP4Bit communication",
    packages=find_packages(include=["megacoat", "megacoat.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "numpy",
        "sentencepiece",
        "tqdm",
        "safetensors",
        # No triton here: torch's CUDA wheels bring it where the Triton kernels can run, and a CPU
        # install must not pay ~1 GB for it (the kernels fall back to their torch references).
    ],
    extras_require={
        # The tests run the Triton kernels on CPU under TRITON_INTERPRET=1, so they need triton.
        "test": ["pytest", "transformers", "safetensors", "tokenizers", "triton; platform_system=='Linux'"],
        "triton": ["triton; platform_system=='Linux'"],
        "wandb": ["wandb"],
        "hf": ["transformers", "tokenizers"],
    },
    setup_requires=[],
    ext_modules=_cpp_extensions(),
    cmdclass={"build_ext": _OptionalBuildExt.make()},
    zip_safe=False,
)
