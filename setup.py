"""Builds megatron_fsdp and its extension `megatron_fsdp._C` from csrc/.

The CPU sources always build; the CUDA sources (csrc/*.cu) join them when the
installed torch has CUDA and nvcc is found. Build with
`pip install --no-build-isolation -e .` so the extension compiles against the
torch already installed (an isolated build would fetch a second torch);
pyproject.toml makes that a PEP 660 build that needs no network.

Supported torch: >= 2.11, < 2.15 (megatron_fsdp/_torch_compat.py's SUPPORTED_TORCH; a
build against another torch prints a warning). torch is not a requirement of the package:
a bare `torch` would pull a multi-GB CUDA build onto CPU machines, and a
pinned one would fight the torch a GPU image already has. scripts/env.sh
installs the right one.

What the build chooses by itself (each choice is printed, prefixed
"[megatron_fsdp setup]"; `pip install -v` shows it):
  * the C++ compiler: CXX (default c++) unless its C++ runtime (libstdc++) is
    not the one torch loads here, in which case a system compiler that links
    that one (an extension built against another runtime crashes when it
    raises an error). MEGATRON_FSDP_KEEP_CXX=1 keeps CXX as given.
  * CUDA architectures, when no GPU is visible (a login node, a container
    build) and TORCH_CUDA_ARCH_LIST is unset: the ones this torch was built
    for that the installed nvcc supports, the newest also as PTX. With a GPU
    visible torch builds for it; TORCH_CUDA_ARCH_LIST always wins.
  * the CUDA runtime to link: the libcudart torch itself loads (pip's CUDA
    runtime ships only libcudart.so.<major>: a libcudart.so link to it is made
    in the build directory).

Environment: MEGATRON_FSDP_NO_CUDA=1 builds the CPU sources only;
MEGATRON_FSDP_KEEP_CXX=1 (above); MAX_JOBS bounds ninja's parallel compiles.
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import warnings

from setuptools import find_packages, setup

# setuptools' PEP 660 note that a folder named like the package in the working
# directory may take precedence over the editable install: here that folder is
# the package itself, so the note says nothing (and `pip install -q` shows it).
warnings.filterwarnings("ignore", message=r"Editable installation\.")

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension, is_ninja_available
except ImportError as exc:  # pragma: no cover - message for a misconfigured build
    raise SystemExit(
        "megatron_fsdp's extension builds against an installed torch: install torch first, "
        "then `pip install --no-build-isolation -e .`"
    ) from exc

here = os.path.dirname(os.path.abspath(__file__))


def log(message: str) -> None:
    print(f"[megatron_fsdp setup] {message}", file=sys.stderr, flush=True)


def _load_build_config():
    """megatron_fsdp/kernels/build_config.py by path: the package itself is not importable yet."""
    path = os.path.join(here, "megatron_fsdp", "kernels", "build_config.py")
    spec = importlib.util.spec_from_file_location("_megatron_fsdp_build_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _load_torch_compat():
    """megatron_fsdp/_torch_compat.py by path: the supported torch range and torch's private names live there."""
    path = os.path.join(here, "megatron_fsdp", "_torch_compat.py")
    spec = importlib.util.spec_from_file_location("_megatron_fsdp_torch_compat", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_config = _load_build_config()
torch_compat = _load_torch_compat()

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
# -g0: Python's own CFLAGS carry -g, and debug information for torch's headers was
# 40% of the compile time; torch's wheels ship without it too.
cxx_flags = ["-O3", "-fno-trapping-math", "-g0"] + openmp
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


def check_torch_version() -> None:
    if not torch_compat.torch_is_supported():
        log(f"WARNING: torch {torch.__version__} is outside the supported range {torch_compat.supported_torch_range()}: "
            "the build may fail or the extension misbehave")


def _nvcc_arches() -> list:
    """The real architectures the installed nvcc compiles for, as "9.0" strings (empty if it cannot say)."""
    try:
        out = subprocess.run([os.path.join(CUDA_HOME, "bin", "nvcc"), "--list-gpu-arch"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return build_config.parse_arches(out, "compute")


def _torch_arches() -> list:
    """The real architectures this torch was built for (torch.cuda.get_arch_list() is empty without a GPU)."""
    return build_config.parse_arches(torch_compat.cuda_arch_flags(), "sm")


def _visible_gpus() -> int:
    try:
        return torch.cuda.device_count()
    except RuntimeError:  # a driver that cannot answer: no GPU to build for
        return 0


class build_ext(BuildExtension.with_options(use_ninja=is_ninja_available())):
    """torch's BuildExtension, choosing the compiler, CUDA architectures and CUDA runtime first."""

    def finalize_options(self):
        super().finalize_options()
        if getattr(self, "editable_mode", False) and getattr(self, "use_ninja", False):
            # setuptools builds an editable install in a fresh temporary directory, so
            # every `pip install -e .` would compile every file again. The regular build
            # directory lets ninja recompile only what changed (it tracks the commands
            # and the headers included, so a new compiler, flag or torch recompiles).
            self.build_temp = os.path.join(here, "build", f"temp.{sysconfig.get_platform()}-"
                                                          f"{sys.implementation.cache_tag}")

    def run(self):
        check_torch_version()
        # Before the compiler objects exist: distutils reads CXX when build_ext.run creates them.
        choice = build_config.choose_compiler(with_cuda=with_cuda)
        for line in choice.lines:
            log(line)
        if choice.cxx:
            os.environ["CXX"] = choice.cxx  # this build's process only
        self._build_info = dict(choice.info, torch=torch.__version__, cuda=torch.version.cuda if with_cuda else None)
        if with_cuda:
            self._configure_cuda(choice)
        else:
            why = ("MEGATRON_FSDP_NO_CUDA=1" if os.environ.get("MEGATRON_FSDP_NO_CUDA", "0") == "1" else
                   "torch has no CUDA" if torch.version.cuda is None else "nvcc not found (set CUDA_HOME)")
            log(f"CUDA kernels: not built ({why}); CPU sources only")
        super().run()

    def _configure_cuda(self, choice):
        for ext in self.extensions:
            if choice.ccbin and isinstance(ext.extra_compile_args, dict):
                ext.extra_compile_args["nvcc"] = ext.extra_compile_args.get("nvcc", []) + ["-ccbin", choice.ccbin]
        arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if arch_list:
            log(f"CUDA architectures: {arch_list} (TORCH_CUDA_ARCH_LIST)")
        elif _visible_gpus() > 0:
            log("CUDA architectures: the visible GPUs' (torch's default; set TORCH_CUDA_ARCH_LIST to choose)")
        else:
            arch_list, why = build_config.default_cuda_arch_list(_torch_arches(), _nvcc_arches(), torch.__version__)
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list  # this build's process only
            log(f"CUDA architectures: {arch_list}: no GPU visible and TORCH_CUDA_ARCH_LIST unset, so {why} "
                "(set TORCH_CUDA_ARCH_LIST to choose)")
        self._build_info["cuda_arch_list"] = os.environ.get("TORCH_CUDA_ARCH_LIST")
        torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
        cudart = build_config.find_cudart(roots=(os.path.dirname(torch_dir), torch_dir))
        if cudart is None:
            log(f"CUDA runtime: torch's not found; linking -lcudart from {CUDA_HOME} and the library path")
            return
        # `-lcudart` needs a file named libcudart.so; pip's runtime has only libcudart.so.<major>.
        link_dir = os.path.join(os.path.abspath(self.build_temp), "megatron_fsdp_cudart")
        link = build_config.link_cudart(cudart, link_dir)
        for ext in self.extensions:
            ext.library_dirs.insert(0, link_dir)
        self._build_info["cudart"] = cudart
        log(f"CUDA runtime: {cudart}, the one torch loads (linked through {link})")

    def build_extension(self, ext):
        super().build_extension(ext)
        # How it was built, beside the .so: the runtime check's message names the compiler from it.
        path = self.get_ext_fullpath(ext.name) + build_config.BUILD_INFO_SUFFIX
        with open(path + ".tmp", "w") as f:  # whole or not at all
            json.dump(getattr(self, "_build_info", {}), f, indent=1)
        os.replace(path + ".tmp", path)

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()  # editable installs and --inplace: the .so into the package
        self.inplace, inplace = False, self.inplace
        built = [self.get_ext_fullpath(ext.name) + build_config.BUILD_INFO_SUFFIX for ext in self.extensions]
        self.inplace = inplace
        for ext, info in zip(self.extensions, built):
            if os.path.exists(info):
                self.copy_file(info, self.get_ext_fullpath(ext.name) + build_config.BUILD_INFO_SUFFIX,
                               level=self.verbose)


# name, version, description and python_requires are also in pyproject.toml's [project]
# (which wins): keep the two in step (tests/test_build.py checks). The dependencies
# (none) and the `test` extra are there only.
setup(
    name="megatron-fsdp2",  # not NVIDIA's "megatron-fsdp" (same import name, other project)
    version="0.1.0",
    description="Megatron-Core-compatible model parallelism on PyTorch FSDP2",
    packages=find_packages(include=["megatron_fsdp", "megatron_fsdp.*"]),
    python_requires=">=3.10",
    # No torch requirement (pyproject.toml's dependencies = []): a bare `torch`
    # would pull a multi-GB CUDA build onto CPU machines. scripts/env.sh
    # installs the right one. Supported: torch >= 2.11, < 2.15 (_torch_compat.SUPPORTED_TORCH).
    ext_modules=[extension],
    # ninja compiles the translation units in parallel (MAX_JOBS, default: all
    # cores): minutes saved with nvcc. Without it, one at a time.
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
