"""Builds megatron_fsdp and its extension `megatron_fsdp._C` from csrc/.

The CPU sources always build; the CUDA sources (csrc/*.cu) join them when the
installed torch has CUDA and nvcc is found. Build with
`pip install --no-build-isolation -e .` so the extension compiles against the
torch already installed (an isolated build would fetch a second torch).
"""

import glob
import os
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension, is_ninja_available
except ImportError as exc:  # pragma: no cover - message for a misconfigured build
    raise SystemExit(
        "megatron_fsdp's extension builds against an installed torch: install torch first, "
        "then `pip install --no-build-isolation -e .`"
    ) from exc

here = os.path.dirname(os.path.abspath(__file__))
cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
cuda_sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
with_cuda = (
    torch.version.cuda is not None and CUDA_HOME is not None
    and os.environ.get("MEGATRON_FSDP_NO_CUDA", "0") != "1"
)
# No -std flag: torch adds the C++ standard its own headers need.
# -fopenmp: at::parallel_for is a header template that runs serially unless
# the including code is compiled with OpenMP. The libgomp.so.1 linked here
# resolves to the one torch loaded first (same soname), so there is one
# thread pool, sized by torch.set_num_threads.
openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
# -fno-trapping-math: lets the compiler evaluate both sides of a select
# with floats in it (branch-free loops vectorize: the fp8 cast). No result
# changes; only floating-point exception flags, which nothing here reads.
cxx_flags = ["-O3", "-fno-trapping-math"] + openmp
if with_cuda:
    extension = CUDAExtension(
        "megatron_fsdp._C",
        cpp_sources + cuda_sources,
        define_macros=[("MEGATRON_FSDP_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
        extra_link_args=openmp,
    )
else:
    extension = CppExtension("megatron_fsdp._C", cpp_sources, extra_compile_args={"cxx": cxx_flags},
                             extra_link_args=openmp)

setup(
    name="megatron_fsdp",
    version="0.1.0",
    description="Megatron-Core-compatible model parallelism on PyTorch FSDP2",
    packages=find_packages(include=["megatron_fsdp", "megatron_fsdp.*"]),
    python_requires=">=3.10",
    # No torch requirement here: a bare `torch` would pull a multi-GB CUDA
    # build onto CPU machines. scripts/env.sh installs the right one.
    install_requires=[],
    extras_require={"test": ["pytest>=7", "numpy", "safetensors"]},
    ext_modules=[extension],
    # ninja compiles the translation units in parallel (MAX_JOBS, default: all
    # cores): minutes saved with nvcc. Without it, one at a time.
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=is_ninja_available())},
    zip_safe=False,
)
