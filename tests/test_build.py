"""The build and its checks (setup.py, pyproject.toml, scripts/env.sh,
megatron_fsdp/kernels/build_check.py):

* a built extension whose errors kill the process instead of raising (a C++
  runtime mismatch: simulated here by a probe child that kills itself with
  SIGSEGV) is caught, cached per .so, and reported with the compiler and both
  C++ runtimes named; the loader then treats the extension as not available;
* setup.py's compiler choice, against a fake compiler whose
  `-print-file-name=libstdc++.so` points elsewhere;
* CUDA build defaults without a GPU (architectures, the CUDA runtime to link);
* an editable install, and scripts/env.sh with MEGATRON_FSDP_VENV=system,
  with pip forbidden any index: from a copy of the tree into a throwaway
  environment that sees .venv's packages.

The installs and every test that starts a child interpreter are marked
`packaging`: a step of their own (scripts/run_tests.sh --step packaging, which
CI runs after the default suite); the rest runs in the default suite.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time

import pytest

from megatron_fsdp.kernels import build_check, build_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _built_extension() -> str:
    spec = importlib.util.find_spec("megatron_fsdp._C")
    if spec is None or not spec.origin:
        if os.environ.get("MEGATRON_FSDP_REQUIRE_EXTENSION") == "1":
            pytest.fail("the extension is not built")
        pytest.skip("the extension is not built")
    return spec.origin


@pytest.fixture
def so_copy(tmp_path):
    """A copy of the built extension in a directory of its own (no build info, no cached verdict)."""
    src = _built_extension()
    d = tmp_path / "ext"
    d.mkdir()
    dst = d / os.path.basename(src)
    shutil.copy2(src, dst)
    return str(dst)


@pytest.fixture
def fake_cxx(tmp_path):
    """A C++ compiler that compiles with the real `c++` but names another libstdc++ (its own runtime)."""
    lib = tmp_path / "fake-gcc" / "lib64"
    lib.mkdir(parents=True)
    (lib / "libstdc++.so").write_bytes(b"not the libstdc++ this process loads\n")
    cxx = tmp_path / "fake-gcc" / "bin" / "g++"
    cxx.parent.mkdir()
    cxx.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        # A module-loaded compiler with its own C++ runtime, as far as anyone asking can tell.
        case "$1" in
          -print-file-name=libstdc++.so) echo "{lib}/libstdc++.so"; exit 0 ;;
          --version) echo "g++ (Fake GCC) 13.3.0"; exit 0 ;;
        esac
        exec c++ "$@"
        """))
    cxx.chmod(0o755)
    return str(cxx), str(lib / "libstdc++.so")


# ---- the probe: a child process makes the extension raise ----

@pytest.mark.packaging  # a child interpreter
def test_probe_passes_on_the_built_extension(so_copy):
    result = build_check.run_probe(so_copy)
    assert result.status == "ok", result.output
    assert "inputs hold 11 elements but out has only 10" in result.output


@pytest.mark.packaging  # a child interpreter
def test_probe_reports_a_child_killed_by_a_signal(so_copy, monkeypatch):
    monkeypatch.setenv(build_check.TEST_SIGNAL_ENV, "SIGSEGV")
    result = build_check.run_probe(so_copy)
    assert result.status == "crashed", result.output
    assert result.signal_name == "SIGSEGV"


@pytest.mark.packaging  # a child interpreter
def test_a_child_signalled_from_outside_is_not_a_crash(so_copy, monkeypatch, tmp_path):
    # SIGTERM/SIGKILL come from a preempted job or the OOM killer, not from a broken C++ runtime:
    # the extension stays available and nothing is cached.
    monkeypatch.setenv(build_check.TEST_SIGNAL_ENV, "SIGTERM")
    monkeypatch.setenv(build_check.CACHE_DIR_ENV, str(tmp_path / "cache"))
    result = build_check.run_probe(so_copy)
    assert result.status == "killed" and result.signal_name == "SIGTERM", result.output
    verdict = build_check.check_extension(so_copy)
    assert verdict.ok and verdict.status == "killed" and "from outside" in verdict.message
    assert not os.path.exists(build_check.cache_path(so_copy))


@pytest.mark.packaging  # a child interpreter
def test_crash_message_names_the_compiler_both_runtimes_and_the_cure(so_copy, fake_cxx, monkeypatch, tmp_path):
    cxx, fake_lib = fake_cxx
    monkeypatch.setenv(build_check.TEST_SIGNAL_ENV, "SIGSEGV")
    monkeypatch.setenv(build_check.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", cxx)
    verdict = build_check.check_extension(so_copy)
    assert not verdict.ok and verdict.status == "crashed"
    message = verdict.message
    assert "SIGSEGV" in message and so_copy in message
    assert f"compiler:  {cxx}" in message and "Fake GCC" in message  # CXX, and what it resolves to
    assert os.path.realpath(fake_lib) in message  # the compiler's -print-file-name=libstdc++.so
    loaded = build_config.loaded_libstdcxx()
    if loaded:
        assert f"after `import torch`: {loaded}" in message
    assert re.search(r"rebuild with the system compiler, e\.g\. `CXX=\S+ pip install --no-build-isolation -e \.`",
                     message), message
    assert build_config.KEEP_CXX_ENV in message and f"{build_check.CHECK_ENV}=0" in message


def test_crash_message_prefers_the_compiler_recorded_at_build_time(so_copy, fake_cxx, monkeypatch):
    cxx, fake_lib = fake_cxx
    with open(so_copy + build_config.BUILD_INFO_SUFFIX, "w") as f:
        json.dump({"cxx": cxx, "cxx_libstdcxx": fake_lib}, f)
    monkeypatch.setenv("CXX", "/usr/bin/g++")
    message = build_check.crash_message(so_copy, build_check.ProbeResult("crashed", -11, ""))
    assert f"compiler:  {cxx}" in message and "recorded by setup.py at build time" in message
    assert f"its libstdc++ (`{cxx} -print-file-name=libstdc++.so`): {fake_lib}" in message
    assert "CXX now: /usr/bin/g++" in message


# ---- the verdict cache ----

class _CountingProbe:
    def __init__(self, result, delay=0.0):
        self.result, self.delay, self.calls = result, delay, 0
        self._lock = threading.Lock()

    def __call__(self, so_path, *args, **kwargs):
        with self._lock:
            self.calls += 1
        time.sleep(self.delay)
        return self.result


def test_verdict_is_cached_per_so_path_size_and_mtime(tmp_path, monkeypatch):
    so = tmp_path / "_C.fake.so"
    so.write_bytes(b"\0" * 64)
    probe = _CountingProbe(build_check.ProbeResult("crashed", -11, "Segmentation fault"))
    monkeypatch.setattr(build_check, "run_probe", probe)
    monkeypatch.delenv(build_check.CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv(build_check.TEST_SIGNAL_ENV, raising=False)
    first = build_check.check_extension(str(so))
    assert not first.ok and probe.calls == 1
    cache = build_check.cache_path(str(so))
    assert cache == os.path.realpath(str(so)) + build_check.CACHE_SUFFIX  # next to the .so: writable here
    assert json.load(open(cache))["key"]["size"] == 64
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".runtime-check-")] == []  # atomic: no leftovers
    again = build_check.check_extension(str(so))
    assert probe.calls == 1 and again == first  # from the cache: no child
    st = so.stat()
    os.utime(so, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rebuilt (same size)
    build_check.check_extension(str(so))
    assert probe.calls == 2
    so.write_bytes(b"\0" * 65)
    build_check.check_extension(str(so))
    assert probe.calls == 3
    build_check.check_extension(str(so), refresh=True)
    assert probe.calls == 4


def test_an_extension_built_against_another_torch_is_refused_unloaded(tmp_path, monkeypatch):
    """setup.py records the torch it built against; under another torch the verdict says so, names
    both versions and the rebuild, and no child process loads the .so (seen loading: a double
    free). The recorded version of this torch passes on to the probe."""
    import torch

    so = tmp_path / "_C.fake.so"
    so.write_bytes(b"\0" * 64)
    info = tmp_path / ("_C.fake.so" + build_config.BUILD_INFO_SUFFIX)
    probe = _CountingProbe(build_check.ProbeResult("ok", 0, ""))
    monkeypatch.setattr(build_check, "run_probe", probe)
    monkeypatch.setenv(build_check.CHECK_ENV, "0")  # the version check comes even before this switch
    info.write_text(json.dumps({"torch": "2.13.0+cu999"}))
    verdict = build_check.check_extension(str(so))
    assert (verdict.ok, verdict.status, probe.calls) == (False, "other_torch", 0)
    assert (f"built against torch 2.13.0+cu999, and this process runs torch {torch.__version__}" in verdict.message
            and "pip install --no-build-isolation -e ." in verdict.message)
    monkeypatch.delenv(build_check.CHECK_ENV)
    monkeypatch.delenv(build_check.TEST_SIGNAL_ENV, raising=False)
    info.write_text(json.dumps({"torch": str(torch.__version__)}))
    assert build_check.check_extension(str(so), use_cache=False).status == "ok" and probe.calls == 1


def test_cache_location_fallbacks(tmp_path, monkeypatch):
    so = tmp_path / "_C.fake.so"
    so.write_bytes(b"x")
    monkeypatch.delenv(build_check.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv(build_check.TEST_SIGNAL_ENV, "SIGSEGV")
    assert build_check.cache_path(str(so)) is None  # a simulated crash is never remembered for a real build
    monkeypatch.setenv(build_check.CACHE_DIR_ENV, str(tmp_path / "cache"))
    assert build_check.cache_path(str(so)).startswith(str(tmp_path / "cache") + os.sep)
    monkeypatch.delenv(build_check.CACHE_DIR_ENV)
    monkeypatch.delenv(build_check.TEST_SIGNAL_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    real_access = os.access
    monkeypatch.setattr(build_check.os, "access", lambda p, m: False if p == str(tmp_path) else real_access(p, m))
    assert build_check.cache_path(str(so)).startswith(str(tmp_path / "xdg" / "megatron_fsdp") + os.sep)


def test_inconclusive_checks_do_not_disable_the_extension(tmp_path, monkeypatch):
    so = tmp_path / "_C.fake.so"
    so.write_bytes(b"x")
    monkeypatch.setenv(build_check.CACHE_DIR_ENV, str(tmp_path / "cache"))
    probe = _CountingProbe(build_check.ProbeResult("timeout", None, "(no answer within 300 s)"))
    monkeypatch.setattr(build_check, "run_probe", probe)
    verdict = build_check.check_extension(str(so))
    assert verdict.ok and verdict.status == "timeout"
    build_check.check_extension(str(so))
    assert probe.calls == 2  # a timeout is not cached: the next import asks again
    probe.result = build_check.ProbeResult("failed", 1, "ImportError: undefined symbol: _ZN3c10")
    verdict = build_check.check_extension(str(so))
    assert verdict.ok and verdict.status == "failed" and "undefined symbol" in verdict.message
    build_check.check_extension(str(so))
    assert probe.calls == 4  # nor is a failure to load: only ok and a crash are kept
    monkeypatch.setenv(build_check.CHECK_ENV, "0")
    assert build_check.check_extension(str(so)).status == "skipped"


def test_concurrent_checks_run_one_child(tmp_path, monkeypatch):
    so = tmp_path / "_C.fake.so"
    so.write_bytes(b"x")
    monkeypatch.setenv(build_check.CACHE_DIR_ENV, str(tmp_path / "cache"))
    probe = _CountingProbe(build_check.ProbeResult("ok", 0, "PROBE OK"), delay=0.5)
    monkeypatch.setattr(build_check, "run_probe", probe)
    verdicts = []
    threads = [threading.Thread(target=lambda: verdicts.append(build_check.check_extension(str(so))))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert probe.calls == 1 and len(verdicts) == 4 and all(v.ok for v in verdicts)


# ---- the loader, in a fresh process ----

def _python(code: str, env: dict, cwd: str = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def _crash_env(tmp_path, cxx):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), CXX=cxx)
    env[build_check.TEST_SIGNAL_ENV] = "SIGSEGV"
    env[build_check.CACHE_DIR_ENV] = str(tmp_path / "cache")
    env.pop("MEGATRON_FSDP_REQUIRE_EXTENSION", None)
    return env


@pytest.mark.packaging
def test_loader_treats_a_crashing_extension_as_not_available(tmp_path, fake_cxx):
    _built_extension()
    cxx, _ = fake_cxx
    env = _crash_env(tmp_path, cxx)
    code = textwrap.dedent("""\
        import json, sys, warnings
        import torch
        from megatron_fsdp import kernels
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            available = kernels.extension_available()
        error = kernels.extension_import_error()
        out = torch.zeros(12)
        kernels.pack_into([torch.ones(5), torch.ones(6)], out)  # the pure-PyTorch fallback
        print(json.dumps({"available": available, "error_type": type(error).__name__, "error": str(error),
                          "warned": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                          "imported": "megatron_fsdp._C" in sys.modules, "packed": out.sum().item()}))
        """)
    proc = _python(code, env)
    assert proc.returncode == 0, proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["available"] is False
    assert result["error_type"] == "ExtensionRuntimeError"
    assert "SIGSEGV" in result["error"] and cxx in result["error"] and "does not match" in result["error"]
    assert result["warned"] and "SIGSEGV" in result["warned"][0]
    assert result["imported"] is False  # never loaded into this process
    assert result["packed"] == 11
    assert len(os.listdir(tmp_path / "cache")) == 1  # the verdict is cached (in the directory given)

    # MEGATRON_FSDP_REQUIRE_EXTENSION=1 (the suite's setting) fails loudly, with the message.
    env["MEGATRON_FSDP_REQUIRE_EXTENSION"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_kernels.py::test_extension_is_built_when_required"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout
    assert "1 failed" in proc.stdout and "SIGSEGV" in proc.stdout and cxx in proc.stdout


@pytest.mark.packaging
def test_build_check_program_stops_a_crashing_build(so_copy, tmp_path, fake_cxx):
    cxx, _ = fake_cxx
    env = _crash_env(tmp_path, cxx)
    script = os.path.join(ROOT, "megatron_fsdp", "kernels", "build_check.py")
    proc = subprocess.run([sys.executable, script, "--so", so_copy], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout
    assert proc.stdout.startswith("BUILD CHECK FAILED: ") and "SIGSEGV" in proc.stdout and cxx in proc.stdout
    del env[build_check.TEST_SIGNAL_ENV]
    proc = subprocess.run([sys.executable, script, "--so", so_copy], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0 and "arrive in Python as exceptions" in proc.stdout, proc.stdout


# ---- setup.py's compiler choice ----

def _runtime_and_system_compiler():
    runtime = build_config.loaded_libstdcxx()
    if runtime is None:
        pytest.skip("no libstdc++ mapped in this process")
    match = build_config.find_matching_compiler(runtime)
    if match is None:
        pytest.skip(f"no system C++ compiler links {runtime}")
    return runtime, match


def test_choose_compiler_replaces_a_cxx_with_another_cxx_runtime(fake_cxx):
    runtime, match = _runtime_and_system_compiler()
    cxx, fake_lib = fake_cxx
    choice = build_config.choose_compiler({"CXX": cxx}, runtime)
    assert choice.cxx == match
    said = " ".join(choice.lines)
    assert f"instead of CXX={cxx}" in said and os.path.realpath(fake_lib) in said and runtime in said
    assert build_config.KEEP_CXX_ENV in said  # the opt-out is named
    assert choice.info["replaced"] == [cxx] and choice.info["cxx"] == match

    kept = build_config.choose_compiler({"CXX": cxx, build_config.KEEP_CXX_ENV: "1"}, runtime)
    assert kept.cxx is None and kept.lines[0].startswith("WARNING") and f"{build_config.KEEP_CXX_ENV}=1" in kept.lines[0]

    # nvcc's host compiler: CC with another runtime gets -ccbin <the matching compiler>.
    cuda = build_config.choose_compiler({"CXX": cxx, "CC": cxx}, runtime, with_cuda=True)
    assert cuda.ccbin == shutil.which(match) and any("-ccbin" in line for line in cuda.lines)


def test_choose_compiler_replaces_a_cxx_that_names_no_runtime(tmp_path):
    # The GPU image's CXX=/opt/gcc/bin/g++: `-print-file-name=libstdc++.so` finds none, and its
    # extension crashed (SIGSEGV) on any error; keeping it "because nothing can be compared" was wrong.
    runtime, match = _runtime_and_system_compiler()
    cxx = tmp_path / "opt-gcc" / "g++"
    cxx.parent.mkdir()
    cxx.write_text('#!/bin/sh\ncase "$1" in -print-file-name=*) echo "${1#-print-file-name=}"; exit 0 ;; esac\n'
                   'exec c++ "$@"\n')
    cxx.chmod(0o755)
    assert build_config.compiler_libstdcxx(str(cxx)) is None
    choice = build_config.choose_compiler({"CXX": str(cxx)}, runtime)
    assert choice.cxx == match and choice.info["replaced"] == [str(cxx)]
    said = " ".join(choice.lines)
    assert f"instead of CXX={cxx}" in said and "cannot be checked" in said and build_config.KEEP_CXX_ENV in said
    assert build_config.choose_compiler({"CXX": str(cxx), build_config.KEEP_CXX_ENV: "1"}, runtime).cxx is None
    # nvcc's host compiler likewise: one that cannot be checked gets -ccbin <the matching compiler>.
    cuda = build_config.choose_compiler({"CXX": str(cxx), "CC": str(cxx)}, runtime, with_cuda=True)
    assert cuda.ccbin == shutil.which(match) and any("names no libstdc++" in line for line in cuda.lines)


def test_choose_compiler_keeps_a_matching_compiler(fake_cxx):
    runtime, match = _runtime_and_system_compiler()
    cxx, fake_lib = fake_cxx
    assert build_config.choose_compiler({"CXX": match}, runtime).cxx is None
    assert build_config.choose_compiler({"CXX": cxx}, fake_lib).cxx is None  # its runtime is the loaded one
    if build_config.same_file(build_config.compiler_libstdcxx("c++"), runtime):
        choice = build_config.choose_compiler({}, runtime)
        assert choice.cxx is None and "CXX unset" in choice.lines[0]
    none = build_config.choose_compiler({"CXX": cxx}, runtime=None)  # unknown runtime: nothing to compare
    assert none.cxx is None


# ---- CUDA builds without a GPU ----

NVCC_13_ARCHES = "compute_75 compute_80 compute_86 compute_87 compute_88 compute_89 compute_90 compute_100 " \
                 "compute_110 compute_103 compute_120 compute_121"
NVCC_12_4_ARCHES = "compute_50 compute_52 compute_53 compute_60 compute_61 compute_62 compute_70 compute_72 " \
                   "compute_75 compute_80 compute_86 compute_87 compute_89 compute_90"
TORCH_CU130_FLAGS = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"  # torch 2.14.1+cu130's _cuda_getArchFlags()


def test_default_cuda_arch_list_without_a_gpu():
    torch_arches = build_config.parse_arches(TORCH_CU130_FLAGS, "sm")
    assert torch_arches == ["7.5", "8.0", "8.6", "9.0", "10.0", "12.0"]
    assert build_config.parse_arches("sm_90a sm_100f compute_90 sm_80", "sm") == ["8.0"]
    arch, why = build_config.default_cuda_arch_list(torch_arches, build_config.parse_arches(NVCC_13_ARCHES, "compute"),
                                                   "2.14.1+cu130")
    assert arch == "7.5;8.0;8.6;9.0;10.0;12.0+PTX" and "torch 2.14.1+cu130" in why
    # An older nvcc than torch's: only what it can compile, the newest as PTX.
    arch, _ = build_config.default_cuda_arch_list(torch_arches, build_config.parse_arches(NVCC_12_4_ARCHES, "compute"))
    assert arch == "7.5;8.0;8.6;9.0+PTX"
    # Nothing known: Ampere and Hopper.
    assert build_config.default_cuda_arch_list([], [])[0] == "8.0;9.0+PTX"
    assert build_config.default_cuda_arch_list(torch_arches, [])[0] == "8.0;9.0+PTX"
    assert build_config.default_cuda_arch_list([], ["9.0", "10.0"])[0] == "9.0+PTX"


def test_cuda_runtime_torch_loads_is_made_linkable(tmp_path):
    site = tmp_path / "site-packages"
    lib = site / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudart.so.13").write_bytes(b"")
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f10 r-xp 00000000 08:01 123 {lib}/libcudart.so.13\n"
                    "7f20-7f30 r-xp 00000000 08:01 124 /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30\n")
    assert build_config.find_cudart(str(maps)) == f"{lib}/libcudart.so.13"
    # Not mapped (yet): pip's runtime beside torch.
    assert build_config.find_cudart(str(tmp_path / "no-maps"), roots=[str(site)]) == str(lib / "libcudart.so.13")
    assert build_config.find_cudart(str(tmp_path / "no-maps"), roots=[str(tmp_path / "empty")]) is None
    links = tmp_path / "build-temp" / "cudart"
    link = build_config.link_cudart(str(lib / "libcudart.so.13"), str(links))
    assert link == str(links / "libcudart.so") and os.readlink(link) == str(lib / "libcudart.so.13")
    assert build_config.link_cudart(str(lib / "libcudart.so.13"), str(links)) == link  # again: unchanged
    (lib / "libcudart.so.14").write_bytes(b"")
    build_config.link_cudart(str(lib / "libcudart.so.14"), str(links))
    assert os.readlink(link) == str(lib / "libcudart.so.14")


# ---- metadata ----

def test_pyproject_agrees_with_setup_py_and_states_the_torch_range():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    setup_py = open(os.path.join(ROOT, "setup.py")).read()
    literal = lambda key: re.search(rf'^\s+{key}="([^"]*)"', setup_py, re.M).group(1)  # noqa: E731
    project = pyproject["project"]
    assert project["name"] == literal("name") and project["version"] == literal("version")
    assert project["requires-python"] == literal("python_requires")
    assert project["description"] == literal("description")
    assert project["dependencies"] == []  # no torch: see the comments
    assert not any(r.split("=")[0].split(">")[0].split("<")[0].strip() == "torch"
                   for r in pyproject["build-system"]["requires"])
    # One range: _torch_compat.SUPPORTED_TORCH, which setup.py reads; the texts say the same.
    from megatron_fsdp import _torch_compat

    stated = _torch_compat.supported_torch_range()
    assert "_torch_compat" in setup_py and stated == "torch >= 2.11, < 2.15"
    for path in ("pyproject.toml", "README.md"):
        assert stated in open(os.path.join(ROOT, path)).read(), path


# ---- installs with no index at all ----

def _offline_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    for name in ("MEGATRON_FSDP_REQUIRE_EXTENSION", "PYTHONPATH", "TORCH_CUDA_ARCH_LIST", "CC"):
        env.pop(name, None)
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS="", PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1",
               MEGATRON_FSDP_NO_CUDA="1", MAX_JOBS="2")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def throwaway(tmp_path_factory):
    """A copy of the tree and a venv without pip that sees this Python's packages (torch, setuptools, pip)."""
    base = tmp_path_factory.mktemp("offline")
    copy = base / "tree"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "copy_tree.py"), str(copy), "--root", ROOT],
                   check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert (copy / "pyproject.toml").exists() and not list((copy / "megatron_fsdp").glob("_C*.so"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
    # A plain path line: .venv's packages importable, its .pth files (its own editable
    # megatron_fsdp) not processed.
    with open(os.path.join(site, "parent-site-packages.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return {"copy": copy, "python": str(python), "site": site, "base": base}


def _import_from_elsewhere(python: str, cwd) -> str:
    proc = subprocess.run([python, "-c", "import megatron_fsdp._C as c; print(c.__file__)"], cwd=str(cwd),
                          env=_offline_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.packaging
def test_editable_install_needs_no_index(throwaway, fake_cxx):
    cxx, _ = fake_cxx
    copy, python = throwaway["copy"], throwaway["python"]
    proc = subprocess.run([python, "-m", "pip", "install", "-v", "--no-index", "--no-build-isolation", "--no-deps",
                           "-e", str(copy)], env=_offline_env(CXX=cxx), cwd=str(throwaway["base"]),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:]
    out = proc.stdout
    assert "setup.py develop" not in out and "Downloading" not in out
    # PEP 660: setuptools' editable wheel, not the legacy develop's egg-link.
    site = throwaway["site"]
    assert os.path.exists(os.path.join(site, "__editable__.megatron_fsdp2-0.1.0.pth"))
    assert not [f for f in os.listdir(site) if f.endswith(".egg-link")]
    # setup.py chose the system compiler over the fake CXX, and said so.
    assert re.search(rf"\[megatron_fsdp setup\] C\+\+ compiler: .*instead of CXX={re.escape(cxx)}", out), out[-5000:]
    (so,) = (copy / "megatron_fsdp").glob("_C*.so")
    info = json.loads(open(str(so) + build_config.BUILD_INFO_SUFFIX).read())
    assert info["cxx"] != cxx and info["replaced"] == [cxx] and info["CXX"] == cxx
    elsewhere = throwaway["base"] / "elsewhere"
    elsewhere.mkdir()
    assert _import_from_elsewhere(python, elsewhere) == str(so)


@pytest.mark.packaging
def test_env_sh_with_the_system_python_works_offline(throwaway, fake_cxx):
    cxx, _ = fake_cxx
    copy, python = throwaway["copy"], throwaway["python"]
    env = _offline_env(MEGATRON_FSDP_VENV="system", PYTHON=python, CXX=cxx)
    proc = subprocess.run(["bash", str(copy / "scripts" / "env.sh")], env=env, cwd=str(throwaway["base"]),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert "[env] building megatron_fsdp" in proc.stdout
    assert "arrive in Python as exceptions" in proc.stdout  # the build check ran
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], stdout=subprocess.PIPE, text=True,
                            check=True).stdout.strip()
    assert os.path.exists(os.path.join(prefix, ".megatron_fsdp_build"))  # the stamp: no rebuild next time
    (so,) = (copy / "megatron_fsdp").glob("_C*.so")
    assert _import_from_elsewhere(python, throwaway["base"]) == str(so)
    # Again: nothing to do.
    proc = subprocess.run(["bash", str(copy / "scripts" / "env.sh")], env=env, cwd=str(throwaway["base"]),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0 and "[env] building" not in proc.stdout, proc.stdout
    # The in-tree extension replaced, as another environment's env.sh (another torch) leaves it:
    # built again for this one.
    with open(so, "ab") as f:
        f.write(b"\0")
    proc = subprocess.run(["bash", str(copy / "scripts" / "env.sh")], env=env, cwd=str(throwaway["base"]),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    assert proc.returncode == 0 and "[env] building" in proc.stdout, proc.stdout[-5000:]
    assert _import_from_elsewhere(python, throwaway["base"]) == str(so)


@pytest.mark.packaging
def test_env_sh_stops_on_a_build_that_crashes_when_it_raises(throwaway, fake_cxx, tmp_path):
    """The build check after the build: a (simulated) crash stops env.sh with the compiler named."""
    cxx, _ = fake_cxx
    copy, python = throwaway["copy"], throwaway["python"]
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], stdout=subprocess.PIPE, text=True,
                            check=True).stdout.strip()
    stamp = os.path.join(prefix, ".megatron_fsdp_build")
    if os.path.exists(stamp):
        os.unlink(stamp)
    env = _offline_env(MEGATRON_FSDP_VENV="system", PYTHON=python, CXX=cxx)
    env[build_check.TEST_SIGNAL_ENV] = "SIGSEGV"
    env[build_check.CACHE_DIR_ENV] = str(tmp_path / "cache")
    proc = subprocess.run(["bash", str(copy / "scripts" / "env.sh")], env=env, cwd=str(throwaway["base"]),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    assert proc.returncode == 1, proc.stdout[-5000:]
    assert "BUILD CHECK FAILED" in proc.stdout and "SIGSEGV" in proc.stdout and cxx in proc.stdout
    assert "recorded by setup.py at build time" in proc.stdout and f"CXX now: {cxx}" in proc.stdout
    assert "[env] the extension just built is broken" in proc.stdout
    assert not os.path.exists(stamp)  # not recorded: the next run builds again
