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


# CUDA C++ kernels of csrc/ (.cu: nvcc; .cpp: the torch bindings and the cuBLASLt GEMM, host compiler only),
# without --use_fast_math: they must match their torch references bit for bit. Without a build they are
# compiled on first use (megacoat.kernels.cuda_ext).
CUDA_EXTENSIONS = {"megacoat._fused_adamw": ["csrc/fused_adamw.cu", "csrc/fused_adamw_binding.cpp"],
                   "megacoat._sdp4bit": ["csrc/sdp4bit_encode.cu", "csrc/sdp4bit_requantize.cu",
                                         "csrc/sdp4bit_binding.cpp"],
                   "megacoat._fp8_gemm": ["csrc/fp8_gemm.cpp"]}
CUDA_LIBRARIES = {"megacoat._fp8_gemm": ["cublasLt"]}


def _cuda_flags(torch) -> list:
    """nvcc flags: machine code for this machine's GPU (sm_90a without one), as megacoat.kernels.cuda_ext.arch_flags;
    with TORCH_CUDA_ARCH_LIST set, torch's own flags for the architectures it lists instead."""
    flags = ["-O3", "-std=c++17"]
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return flags
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    arch = "%d%d" % tuple(cap) + ("a" if tuple(cap) == (9, 0) else "")
    return flags + [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def _cuda_extensions():
    """(extensions, torch's BuildExtension) when torch with CUDA and nvcc exist in the build
    environment; else ([], None), silently: pip's build isolation usually has no torch, and a CPU
    install must never pull a CUDA torch. MEGACOAT_NO_CUDA_EXT=1 skips them."""
    if os.environ.get("MEGACOAT_NO_CUDA_EXT") == "1" or os.environ.get("MEGACOAT_NO_EXT") == "1":
        return [], None
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception:  # noqa: BLE001 - no torch here: nothing to build
        return [], None
    if torch.version.cuda is None or CUDA_HOME is None:
        return [], None
    exts = [CUDAExtension(name, srcs, extra_compile_args={"cxx": ["-O3"], "nvcc": _cuda_flags(torch)},
                          libraries=CUDA_LIBRARIES.get(name, []))
            for name, srcs in CUDA_EXTENSIONS.items() if all(os.path.exists(x) for x in srcs)]
    return exts, BuildExtension


class _OptionalBuildExt:
    """build_ext that warns instead of failing: compiled helpers are accelerators, never required."""

    @staticmethod
    def make(base=None):
        from setuptools.command.build_ext import build_ext

        class OptionalBuildExt(base or build_ext):
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


_CUDA_EXTS, _CUDA_BUILD = _cuda_extensions()

setup(
    name="megacoat",
    version="0.1.0",
    description="Megatron-style GPT pretraining with COAT FP8 training and SDP4Bit communication",
    packages=find_packages(include=["megacoat", "megacoat.*"]),
    package_data={"megacoat.training.hardware": ["*.json"]},  # the machine files of the step-time model
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
        "test": ["pytest", "transformers", "safetensors", "tokenizers", "triton; platform_system=='Linux'",
                 "wandb", "tensorboard", "matplotlib",  # the tracking and run-plot tests
                 # Megatron-LM checkpoint tests build megatron-core's GPTModel (deps: torch, numpy, packaging);
                 # psutil for its dist_checkpointing.save (torch_dist test). Pinned: tested API.
                 "megatron-core==0.16.1", "psutil"],
        "triton": ["triton; platform_system=='Linux'"],
        "wandb": ["wandb"],
        "hf": ["transformers", "tokenizers"],
    },
    setup_requires=[],
    ext_modules=_cpp_extensions() + _CUDA_EXTS,
    cmdclass={"build_ext": _OptionalBuildExt.make(_CUDA_BUILD)},
    zip_safe=False,
)
