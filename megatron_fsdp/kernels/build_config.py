"""What setup.py decides before it compiles megatron_fsdp._C, each choice printed.

  * the C++ compiler (`choose_compiler`): CXX when it links the libstdc++ the
    Python process loads with torch, else a system compiler that does. An
    extension built against another C++ runtime dies (SIGSEGV) the first time
    it formats a number into an error (build_check.py finds that out after a
    build; this avoids it before). MEGATRON_FSDP_KEEP_CXX=1 keeps CXX.
  * the CUDA architectures when no GPU is visible (`default_cuda_arch_list`):
    those this torch was built for that nvcc supports, the newest also as PTX.
  * the CUDA runtime to link (`find_cudart`, `link_cudart`): the libcudart
    torch itself loads, linked under the name the linker looks for.

Only the standard library at module level: setup.py loads this file by path,
before megatron_fsdp is importable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import shutil
import subprocess
import sysconfig

KEEP_CXX_ENV = "MEGATRON_FSDP_KEEP_CXX"
BUILD_INFO_SUFFIX = ".build.json"  # written by setup.py next to the .so: how it was built


# ---- which C++ runtime: loaded here, and the one a compiler links ----

def loaded_libstdcxx() -> str | None:
    """The libstdc++ this process has mapped (after `import torch`: the one the extension meets)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6 and "/libstdc++.so" in parts[5]:
                    return os.path.realpath(parts[5].strip())
    except OSError:
        pass
    return None


def compiler_libstdcxx(compiler: str) -> str | None:
    """`<compiler> -print-file-name=libstdc++.so`, resolved: the runtime it links. None if it names none."""
    try:
        out = subprocess.run(shlex.split(compiler) + ["-print-file-name=libstdc++.so"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return os.path.realpath(out) if os.path.isabs(out) and os.path.exists(out) else None


def resolve_compiler(compiler: str) -> str:
    """'CXX value -> the file it runs' for messages, e.g. 'c++ -> /usr/bin/x86_64-linux-gnu-g++-12'."""
    try:
        words = shlex.split(compiler)
    except ValueError:
        words = []
    exe = shutil.which(words[0]) if words else None
    if exe is None:
        return f"{compiler} (not found)"
    real = os.path.realpath(exe)
    version = ""
    try:
        first = subprocess.run(words + ["--version"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               timeout=60).stdout.strip().splitlines()
        version = f", {first[0]}" if first else ""
    except (OSError, subprocess.SubprocessError):
        pass
    shown = exe if exe == real else f"{exe} -> {real}"
    return f"{compiler} -> {shown}{version}" if shown != compiler else f"{compiler}{version}"


def same_file(a: str | None, b: str | None) -> bool:
    """The same library: one path, or byte-identical copies."""
    if not a or not b:
        return False
    a, b = os.path.realpath(a), os.path.realpath(b)
    if a == b:
        return True
    try:
        if os.path.getsize(a) != os.path.getsize(b):
            return False
        return _sha256(a) == _sha256(b)
    except OSError:
        return False


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


SYSTEM_CXX_CANDIDATES = ("/usr/bin/c++", "/usr/bin/g++", "c++", "g++", "clang++")


def find_matching_compiler(runtime: str, candidates=SYSTEM_CXX_CANDIDATES, exclude=()) -> str | None:
    """The first C++ compiler (system ones first) that links `runtime`."""
    seen = {os.path.realpath(p) for p in (shutil.which(e) for e in exclude) if p}
    for name in candidates:
        exe = shutil.which(name)
        if exe is None or os.path.realpath(exe) in seen:
            continue
        seen.add(os.path.realpath(exe))
        if same_file(compiler_libstdcxx(exe), runtime):
            return exe
    return None


@dataclasses.dataclass
class CompilerChoice:
    cxx: str | None  # a value for CXX, when it must change; None: keep
    ccbin: str | None  # a host compiler for nvcc (-ccbin), when its default does not match; None: keep
    lines: list  # what was chosen and why, for the build output
    info: dict  # recorded next to the built .so


def choose_compiler(environ=None, runtime: str | None = "detect", with_cuda: bool = False) -> CompilerChoice:
    """Pick a C++ compiler whose C++ runtime is the one this process (with torch imported) loads.

    CXX (default: `c++`, as torch's build uses) is kept when its libstdc++ is the
    loaded one, or when MEGATRON_FSDP_KEEP_CXX=1. A CXX that links another
    runtime, or that names none (`-print-file-name` finds no libstdc++, so which
    runtime it links cannot be checked: the GPU image's /opt/gcc/bin/g++ is
    such a one, and its builds crashed), is replaced by the first system
    compiler that links the loaded runtime; with none, it is kept (with a
    warning when it is known to differ; the check after the build then tells).
    With CUDA, nvcc's host compiler (CC when set, else gcc from PATH) is
    checked the same way and -ccbin chosen when it differs or cannot be checked.
    """
    environ = os.environ if environ is None else environ
    runtime = loaded_libstdcxx() if runtime == "detect" else runtime  # None: unknown
    keep = environ.get(KEEP_CXX_ENV, "") == "1"
    given = environ.get("CXX") or None
    lines: list = []
    info = {"CXX": given, "loaded_libstdcxx": runtime}
    if runtime is None:
        compiler = given or "c++"
        lines.append(f"C++ compiler: {resolve_compiler(compiler)} (which libstdc++ this Python loads is unknown: "
                     "nothing to compare)")
        info.update(cxx=compiler, cxx_resolved=resolve_compiler(compiler))
        return CompilerChoice(None, None, lines, info)

    # Without CXX, torch compiles with `c++` and distutils links with Python's configured CXX.
    if given:
        current = [given]
    else:
        current = ["c++"]
        configured = (sysconfig.get_config_var("CXX") or "").split()
        if configured and configured[0] != "c++":
            current.append(configured[0])
    runtimes = [(c, compiler_libstdcxx(c)) for c in current]
    mismatched = [(c, rt) for c, rt in runtimes if rt is not None and not same_file(rt, runtime)]
    unverified = [c for c, rt in runtimes if rt is None]
    cxx = None
    chosen = given or "c++"
    how = "CXX" if given else "CXX unset"
    match = None if (keep or mismatched or not unverified) else find_matching_compiler(runtime, exclude=unverified)
    if match is not None:
        cxx = chosen = match
        what = f"CXX={given}" if given else f"the default compiler {unverified[0]}"
        lines.append(f"C++ compiler: {resolve_compiler(match)}, instead of {what} ({resolve_compiler(unverified[0])}): "
                     "that one names no libstdc++ of its own (-print-file-name finds none), so whether it links "
                     f"{runtime}, the one this Python loads with torch, cannot be checked, and an extension built "
                     f"against another C++ runtime crashes (SIGSEGV) when it raises an error. {match} links "
                     f"{runtime}. Set {KEEP_CXX_ENV}=1 to keep CXX as given.")
    elif not mismatched:
        rt = compiler_libstdcxx(chosen)
        lines.append(f"C++ compiler: {resolve_compiler(chosen)} ({how}; "
                     + (f"it links {rt}, the libstdc++ torch loads)" if rt else
                        "no libstdc++ of its own to compare, and no system compiler links the one torch loads)"))
    else:
        bad, bad_rt = mismatched[0]
        what = f"CXX={given}" if given else f"the default compiler {bad}"
        if keep:
            lines.append(f"WARNING: {what} ({resolve_compiler(bad)}) links {bad_rt}, but this Python loads {runtime} "
                         f"with torch; kept because {KEEP_CXX_ENV}=1. An extension built with it can crash "
                         "(SIGSEGV) when it raises an error; the check after the build will tell.")
        else:
            match = find_matching_compiler(runtime, exclude=[c for c, _ in mismatched])
            if match is None:
                lines.append(f"WARNING: {what} ({resolve_compiler(bad)}) links {bad_rt}, but this Python loads "
                             f"{runtime} with torch, and no system compiler ({', '.join(SYSTEM_CXX_CANDIDATES)}) links "
                             "that one: kept. An extension built with it can crash (SIGSEGV) when it raises an "
                             "error; the check after the build will tell.")
            else:
                cxx = chosen = match
                lines.append(f"C++ compiler: {resolve_compiler(match)}, instead of {what} ({resolve_compiler(bad)}): "
                             f"that one links {bad_rt}, but this Python loads {runtime} with torch, and an extension "
                             f"built against another C++ runtime crashes (SIGSEGV) when it raises an error. "
                             f"{match} links {runtime}. Set {KEEP_CXX_ENV}=1 to keep CXX as given.")
    info.update(cxx=chosen, cxx_resolved=resolve_compiler(chosen), cxx_libstdcxx=compiler_libstdcxx(chosen),
                replaced=([c for c, _ in mismatched] or unverified) if cxx else [])

    ccbin = None
    if with_cuda:
        host = environ.get("CC") or "gcc"
        host_rt = compiler_libstdcxx(host)
        if not same_file(host_rt, runtime):
            links = f"links {host_rt}" if host_rt else "names no libstdc++ to check"
            if keep:
                lines.append(f"WARNING: nvcc's host compiler {resolve_compiler(host)} {links} (this Python loads "
                             f"{runtime}): kept ({KEEP_CXX_ENV}=1)")
            else:
                ccbin = chosen if same_file(compiler_libstdcxx(chosen), runtime) else find_matching_compiler(runtime)
                if ccbin:
                    ccbin = shutil.which(shlex.split(ccbin)[0]) or ccbin
                    lines.append(f"nvcc host compiler: -ccbin {ccbin}, instead of {resolve_compiler(host)} "
                                 f"(that one {links}; this Python loads {runtime})")
        info["ccbin"] = ccbin
    return CompilerChoice(cxx, ccbin, lines, info)


# ---- CUDA builds that see no GPU (setup.py) ----

def parse_arches(text: str, prefix: str) -> list:
    """"sm_75 sm_90a compute_120" with prefix "sm" -> ["7.5"] (real architectures, no "a"/"f" variants)."""
    import re
    return [f"{int(n) // 10}.{int(n) % 10}" for n in re.findall(rf"\b{prefix}_(\d+)\b", text)]


def default_cuda_arch_list(torch_arches: list, nvcc_arches: list, torch_version: str = "") -> tuple:
    """(TORCH_CUDA_ARCH_LIST, why) for a build without a visible GPU: the architectures torch was
    built for that nvcc supports, the newest also as PTX (newer GPUs compile it when loading);
    without either list, 8.0;9.0+PTX (Ampere, Hopper)."""
    def key(arch):
        return tuple(int(x) for x in arch.split("."))
    arches = sorted(set(torch_arches) & set(nvcc_arches), key=key) if torch_arches and nvcc_arches else []
    if arches:
        who = f"torch {torch_version}" if torch_version else "torch"
        why = f"the architectures {who} was built for ({' '.join(torch_arches)}) that nvcc supports"
    else:
        arches = [a for a in ("8.0", "9.0") if not nvcc_arches or a in nvcc_arches] or ["9.0"]
        why = (f"a fixed default (torch's architectures: {' '.join(torch_arches) or 'unknown'}; nvcc's: "
               f"{' '.join(nvcc_arches) or 'unknown'})")
    arches[-1] += "+PTX"
    return ";".join(arches), why


def find_cudart(maps_path: str = "/proc/self/maps", roots=()) -> str | None:
    """The CUDA runtime library this process loaded (torch's, after `import torch`), else one
    that pip's CUDA runtime put beside torch under one of `roots` (site-packages, torch/)."""
    import glob
    import re
    try:
        with open(maps_path) as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip()
                if re.search(r"/libcudart\.so(\.\d+)*$", path):
                    return path
    except OSError:
        pass
    for root in roots:
        for pattern in ("nvidia/*/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*", "lib/libcudart*.so*"):
            found = sorted(glob.glob(os.path.join(root, pattern)))
            if found:
                return found[0]
    return None


def link_cudart(cudart: str, directory: str) -> str:
    """A `libcudart.so` in `directory` pointing at `cudart` (`-lcudart` needs that name; pip's
    runtime has only libcudart.so.<major>). Returns the link's path."""
    os.makedirs(directory, exist_ok=True)
    link = os.path.join(directory, "libcudart.so")
    if not (os.path.islink(link) and os.readlink(link) == cudart):
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(cudart, link)
    return link
