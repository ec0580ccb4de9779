"""Does an error raised inside megatron_fsdp._C arrive in Python as an exception?

A C++ extension built by a compiler whose C++ runtime (libstdc++) is not the
one the Python process loads can import and run fine, then die (SIGSEGV) the
first time it formats a number into an error message: a TORCH_CHECK with a
number in it, the usual way the extension reports bad arguments. Seen with a
GPU image's `CXX=/opt/gcc/bin/g++` (g++ 13.3 with its own libstdc++; Python's
LDSHARED adds `-Wl,-Bsymbolic-functions`, so the extension's own copies of
libstdc++'s stream functions bind inside it), and with module-loaded
compilers on clusters. The cure is to rebuild with the system compiler.

This module finds that out in a child process, so that the crash kills the
child, not the caller:

  * `check_extension(path)`: the verdict for one built .so, cached per file
    (path, size, mtime) in `<the .so>.runtime-check.json` (or a cache
    directory when that is not writable). megatron_fsdp.kernels calls it
    before importing the extension: a broken build makes
    `extension_available()` False, with this module's message as the import
    error, instead of killing the process later.
  * run as a program after a build (scripts/env.sh, scripts/gpu_check.sh):
    `python megatron_fsdp/kernels/build_check.py --package-dir megatron_fsdp`
    exits 1 with a message naming the compiler and both C++ runtimes.
  (setup.py picks a compiler whose runtime is the one torch loads before it
  builds: build_config.py.)

Only the standard library is imported at module level (setup.py loads this
file before megatron_fsdp is importable); torch is imported where needed.

Environment:
  MEGATRON_FSDP_EXTENSION_CHECK=0        skip the check at import (trust the build)
  MEGATRON_FSDP_EXTENSION_CHECK_CACHE    directory for the cached verdicts (default:
                                         next to the .so, else ~/.cache/megatron_fsdp)
  MEGATRON_FSDP_EXTENSION_CHECK_TIMEOUT  seconds the child may take (default 300)
  MEGATRON_FSDP_KEEP_CXX=1               setup.py keeps CXX (and nvcc's host compiler) as given
  MEGATRON_FSDP_TEST_PROBE_SIGNAL        tests only: the child kills itself with this signal
                                         (e.g. SIGSEGV) where it would call the extension
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.machinery
import json
import os
import signal
import subprocess
import sys
import tempfile

try:  # a module of the package, or run as a script (python megatron_fsdp/kernels/build_check.py)
    from .build_config import (BUILD_INFO_SUFFIX, KEEP_CXX_ENV, compiler_libstdcxx, find_matching_compiler,
                               loaded_libstdcxx, resolve_compiler, same_file)
except ImportError:
    from build_config import (BUILD_INFO_SUFFIX, KEEP_CXX_ENV, compiler_libstdcxx,  # type: ignore[no-redef]
                              find_matching_compiler, loaded_libstdcxx, resolve_compiler, same_file)

CHECK_ENV = "MEGATRON_FSDP_EXTENSION_CHECK"
CACHE_DIR_ENV = "MEGATRON_FSDP_EXTENSION_CHECK_CACHE"
TIMEOUT_ENV = "MEGATRON_FSDP_EXTENSION_CHECK_TIMEOUT"
TEST_SIGNAL_ENV = "MEGATRON_FSDP_TEST_PROBE_SIGNAL"

# Bumped when the probe changes, so that cached verdicts of an older probe are not trusted.
PROBE_VERSION = 1
CACHE_SUFFIX = ".runtime-check.json"

# The child: load the .so by path (no megatron_fsdp import), then call one op,
# through the dispatcher and directly, with arguments whose error message
# formats numbers ("inputs hold 11 elements but out has only 10").
_PROBE = r"""
import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
import importlib.util, os, signal
import torch
spec = importlib.util.spec_from_file_location("megatron_fsdp._C", sys.argv[1])
ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ext)
hook = os.environ.get("MEGATRON_FSDP_TEST_PROBE_SIGNAL")
if hook:
    sys.stdout.flush()
    os.kill(os.getpid(), int(hook) if hook.isdigit() else getattr(signal, hook))
def raised(call, name):
    try:
        call()
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0]
    print(f"PROBE: {name} raised nothing for 11 elements into 10 (expected a RuntimeError)")
    sys.exit(3)
args = lambda: ([torch.ones(5), torch.ones(6)], torch.zeros(10))
first = raised(lambda: torch.ops.megatron_fsdp.pack_into(*args()), "torch.ops.megatron_fsdp.pack_into")
raised(lambda: ext.pack_into(*args()), "megatron_fsdp._C.pack_into")
print("PROBE OK:", first)
"""


@dataclasses.dataclass
class ProbeResult:
    # "ok" | "crashed" (a fault signal) | "killed" (another signal) | "failed" (exited non-zero) | "timeout"
    status: str
    returncode: int | None
    output: str

    @property
    def signal_name(self) -> str:
        if self.returncode is None or self.returncode >= 0:
            return ""
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"


@dataclasses.dataclass
class Verdict:
    """ok: errors raised in the extension arrive as exceptions (or the check could
    not tell: `status` says which). Only a crash makes ok False."""

    ok: bool
    status: str  # "ok" | "crashed" | "other_torch" | "killed" | "failed" | "timeout" | "skipped"
    message: str = ""


def run_probe(so_path: str, python: str | None = None, timeout: float | None = None,
              env: dict | None = None) -> ProbeResult:
    """Load `so_path` in a child Python and make it raise an error with numbers in it."""
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_ENV, "120"))
    cmd = [python or sys.executable, "-c", _PROBE, os.path.abspath(so_path)]
    try:
        # Its own session: a SIGTERM or SIGINT meant for the caller's process group (a
        # preempted job) must not reach the child and pass for a crash of the build.
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                              timeout=timeout, env=env, cwd=os.path.dirname(os.path.abspath(so_path)),
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else (exc.output or "")
        return ProbeResult("timeout", None, out + f"\n(no answer within {timeout:g} s)")
    if proc.returncode == 0 and "PROBE OK" in proc.stdout:
        return ProbeResult("ok", 0, proc.stdout)
    if -proc.returncode in _FAULT_SIGNALS:
        return ProbeResult("crashed", proc.returncode, proc.stdout)
    if proc.returncode < 0:  # SIGKILL (the OOM killer, say), SIGTERM: says nothing about the build
        return ProbeResult("killed", proc.returncode, proc.stdout)
    return ProbeResult("failed", proc.returncode, proc.stdout)


# What a broken C++ runtime does to a process; any other signal came from outside.
_FAULT_SIGNALS = {int(getattr(signal, name)) for name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE")
                  if hasattr(signal, name)}


# ---- the verdict, cached per built .so ----

def _torch_identity() -> str:
    import torch
    return f"{torch.__version__} {os.path.dirname(os.path.realpath(torch.__file__))}"


def _cache_key(so_path: str) -> dict:
    st = os.stat(so_path)
    return {"so": os.path.realpath(so_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "torch": _torch_identity(), "probe": PROBE_VERSION, "test_signal": os.environ.get(TEST_SIGNAL_ENV, "")}


def cache_path(so_path: str) -> str | None:
    """Where the verdict for `so_path` is kept; None: nowhere (a test hook without a cache directory)."""
    real = os.path.realpath(so_path)
    name = f"{hashlib.sha256(real.encode()).hexdigest()[:16]}-{os.path.basename(real)}{CACHE_SUFFIX}"
    directory = os.environ.get(CACHE_DIR_ENV)
    if directory:
        return os.path.join(directory, name)
    if os.environ.get(TEST_SIGNAL_ENV):
        return None  # a simulated crash must never be remembered for a real build
    if os.access(os.path.dirname(real), os.W_OK):
        return real + CACHE_SUFFIX
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_fsdp", name)


def _read_cache(path: str | None, key: dict) -> Verdict | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("key") == key:
            return Verdict(bool(data["ok"]), str(data["status"]), str(data.get("message", "")))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_cache(path: str | None, key: dict, verdict: Verdict) -> None:
    """Atomically (a temporary file renamed over it); silently nothing where it cannot be written."""
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".runtime-check-", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, **dataclasses.asdict(verdict)}, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError:
        pass


@contextlib.contextmanager
def _locked(directory: str | None):
    """One checker at a time per cache directory (the others then read its verdict)."""
    fd = None
    try:
        import fcntl
        fd = os.open(directory, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except (ImportError, OSError, TypeError):
        if fd is not None:
            os.close(fd)
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the lock


def read_build_info(so_path: str) -> dict:
    try:
        with open(so_path + BUILD_INFO_SUFFIX) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _comment_section_compilers(so_path: str) -> list:
    """The compiler versions the object files record ("GCC: (GNU) 13.3.0"), from the .so's bytes."""
    import re
    try:
        with open(so_path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    found = []
    for m in re.finditer(rb"(?:GCC|clang version)[:]? [ -~]{1,100}", data):
        s = m.group().decode("ascii", "replace")
        if s not in found:
            found.append(s)
    return found[:4]


def crash_message(so_path: str, result: ProbeResult, environ=None) -> str:
    """Why an error raised in the extension kills the process, and what to do about it."""
    environ = os.environ if environ is None else environ
    info = read_build_info(so_path)
    loaded = loaded_libstdcxx()
    compiler = info.get("cxx") or environ.get("CXX") or "c++"
    source = ("recorded by setup.py at build time" if info.get("cxx") else
              "CXX now; the compiler used was not recorded" if environ.get("CXX") else
              "CXX unset: torch's default c++; the compiler used was not recorded")
    its = info.get("cxx_libstdcxx") if info.get("cxx") else compiler_libstdcxx(compiler)
    sig = result.signal_name or "crashed"
    fix = find_matching_compiler(loaded) if loaded else None
    fix = fix or "/usr/bin/g++"
    lines = [
        f"megatron_fsdp._C ({so_path}) is broken: an error raised inside it kills the process ({sig}) instead of "
        "arriving in Python as an exception (checked in a child process: pack_into with 11 elements into 10).",
        "The usual cause: it was built by a C++ compiler whose C++ runtime (libstdc++) does not match the one this "
        "Python process loads with torch.",
        f"  compiler:  {resolve_compiler(compiler)}  ({source})",
        f"  its libstdc++ (`{compiler} -print-file-name=libstdc++.so`): {its or 'not found'}",
        f"  libstdc++ loaded by this Python after `import torch`: {loaded or 'unknown'}",
    ]
    if environ.get("CXX") and environ.get("CXX") != compiler:
        lines.append(f"  CXX now: {resolve_compiler(environ['CXX'])}")
    comments = _comment_section_compilers(so_path)
    if comments:
        lines.append(f"  compilers recorded in the .so: {'; '.join(comments)}")
    if its and loaded and same_file(its, loaded):
        lines.append("  (these two are the same file: the mismatch is elsewhere, e.g. a wrapper that links "
                     "libstdc++ statically, or LD_PRELOAD / LD_LIBRARY_PATH at build or run time)")
    lines += [
        f"Fix: rebuild with the system compiler, e.g. `CXX={fix} pip install --no-build-isolation -e .` "
        f"(or `CXX={fix} bash scripts/env.sh`, `CXX={fix} python setup.py build_ext --inplace`).",
        f"setup.py picks such a compiler itself unless {KEEP_CXX_ENV}=1; to use this build anyway at your own risk, "
        f"set {CHECK_ENV}=0.",
    ]
    tail = [ln for ln in result.output.strip().splitlines() if ln.strip()][-5:]
    if tail:
        lines.append("Child's last output: " + " | ".join(tail))
    return "\n".join(lines)


def _verdict(so_path: str, result: ProbeResult) -> Verdict:
    if result.status == "ok":
        return Verdict(True, "ok")
    if result.status == "crashed":
        return Verdict(False, "crashed", crash_message(so_path, result))
    tail = "\n".join(result.output.strip().splitlines()[-15:])
    what = {"timeout": "did not answer", "killed": f"was killed by {result.signal_name} (from outside: not a "
            "crash of the build)"}.get(result.status, f"exited with status {result.returncode}")
    return Verdict(True, result.status, f"the check of {so_path} in a child process {what}:\n{tail}")


def _other_torch_message(so_path: str) -> str:
    """Why the extension cannot be used with the torch imported here, or "": it was built against
    another torch (setup.py records the version). Torch's C++ ABI is not kept between releases,
    nor between a CPU and a CUDA build of one release: such an extension may load and then free
    memory twice (seen: built for 2.13.0+cpu, loaded under 2.14.1+cu130)."""
    import torch

    built = read_build_info(so_path).get("torch")
    if not built or built == str(torch.__version__):
        return ""
    return (f"{so_path} was built against torch {built}, and this process runs torch {torch.__version__}: a C++ "
            f"extension works only with the torch it was compiled against. Rebuild it under this torch: "
            f"`pip install --no-build-isolation -e .` (or `bash scripts/env.sh`)")


def check_extension(so_path: str, use_cache: bool = True, refresh: bool = False) -> Verdict:
    """The verdict for the built extension at `so_path` (cached per file: path, size, mtime).
    refresh: check again even when a verdict is cached (and cache the new one). An extension
    built against another torch is refused even with the check switched off (CHECK_ENV=0):
    that switch skips the child process, not the version comparison."""
    other_torch = _other_torch_message(so_path)
    if other_torch:  # before the probe: loading it can corrupt memory rather than raise
        return Verdict(False, "other_torch", other_torch)
    if os.environ.get(CHECK_ENV, "1") == "0":
        return Verdict(True, "skipped", f"{CHECK_ENV}=0")
    if not sys.executable:
        return Verdict(True, "skipped", "no Python executable to run the check with")
    key = _cache_key(so_path)
    path = cache_path(so_path) if use_cache else None
    cached = None if refresh else _read_cache(path, key)
    if cached is not None:
        return cached
    if path is not None:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    with _locked(os.path.dirname(path) if path else None):
        cached = None if refresh else _read_cache(path, key)  # another process may have checked meanwhile
        if cached is not None:
            return cached
        verdict = _verdict(so_path, run_probe(so_path))
        if verdict.status in ("ok", "crashed"):  # only a conclusive answer is kept
            _write_cache(path, key, verdict)
    return verdict


def find_built_extension(package_dir: str) -> str | None:
    """`<package_dir>/_C<suffix>` for this interpreter's extension suffixes."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(package_dir, "_C" + suffix)
        if os.path.exists(path):
            return path
    return None


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description="Check that errors raised in megatron_fsdp._C arrive in Python "
                                     "as exceptions (a C++ runtime mismatch makes them crash the process).")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--so", help="the built extension")
    where.add_argument("--package-dir", help="the megatron_fsdp package directory holding _C*.so")
    parser.add_argument("--refresh", action="store_true", help="check even when a verdict is cached")
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]  # run as a script: its directory's modules must not shadow torch's imports
    so = args.so or find_built_extension(args.package_dir)
    if not so or not os.path.exists(so):
        print(f"build check: no built extension found ({args.so or args.package_dir})", file=sys.stderr)
        return 2
    so = os.path.abspath(so)
    import torch  # noqa: F401  (the libstdc++ the extension meets is the one loaded after torch)
    verdict = check_extension(so, refresh=args.refresh)
    if verdict.status in ("crashed", "other_torch", "failed", "timeout", "killed"):
        print(f"BUILD CHECK FAILED: {verdict.message}", file=sys.stderr)
        return 1
    if verdict.status == "skipped":
        print(f"build check of {so} skipped: {verdict.message}", file=sys.stderr)
    else:
        info = read_build_info(so)
        built = f" (built with {info['cxx_resolved']})" if info.get("cxx_resolved") else ""
        print(f"build check: errors raised in {so} arrive in Python as exceptions{built}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
