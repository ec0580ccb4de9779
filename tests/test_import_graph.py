"""The package's layering, read from its imports (every import statement, those
inside functions included): no cycle between modules, no lower package importing
the data-parallel wrapper or the training loop, `import megatron_fsdp` loads
only what it exposes, and a job's start-up loads no more than it uses."""

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megatron_fsdp"


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _imported(module: str, is_package: bool, node, modules) -> set[str]:
    """The package's modules that one import statement names."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts) + (f".{node.module}" if node.module else "")
        submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
        # `from pkg import submodule` imports the submodule; any other name comes from pkg itself.
        targets = submodules + ([base] if len(submodules) < len(node.names) else [])
    found = set()
    for target in targets:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        # A module's own parent packages run before it whatever it imports: not an edge.
        if target in modules and target != module and not module.startswith(target + "."):
            found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        graph[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module] |= _imported(module, path.endswith("__init__.py"), node, modules)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = import_graph()
    cycles = _cycles(graph)
    described = [[f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c] for c in cycles]
    assert not cycles, described


def test_lower_packages_import_neither_the_wrapper_nor_the_training_loop():
    # NVIDIA Megatron-FSDP's API (fully_shard, MegatronFSDP) sits on the wrapper's FSDP plan, at
    # the module paths NVIDIA's package uses: an upper layer, as the training loop is.
    nvidia_api = (f"{PACKAGE}.fully_shard", f"{PACKAGE}.megatron_fsdp")
    upper = {f"{PACKAGE}.distributed": (f"{PACKAGE}.distributed", f"{PACKAGE}.training", *nvidia_api),
             f"{PACKAGE}.training": (f"{PACKAGE}.training",)}
    wrong = [f"{module} -> {target}" for module, targets in import_graph().items() for target in targets
             for top, allowed in upper.items()
             if (target == top or target.startswith(top + ".")) and not module.startswith(allowed)]
    assert not wrong, wrong


def test_the_scan_sees_function_level_and_relative_imports():
    graph = import_graph()
    # parallel_state's destroy hook is the only tie between it and tensor_parallel: the scan must see
    # tensor_parallel.random's module-level `from .. import parallel_state`.
    assert f"{PACKAGE}.parallel_state" in graph[f"{PACKAGE}.tensor_parallel.random"]
    # fsdp_plan imports the copy-kernel adapter inside a function.
    assert f"{PACKAGE}.kernels.fsdp_copy_ops" in graph[f"{PACKAGE}.distributed.fsdp_plan"]


def _loaded_after(*imports: str) -> list[set[str]]:
    """In a fresh interpreter, the modules loaded after each import in turn (cumulative)."""
    code = ("import json, sys\n"
            "loaded = []\n"
            f"for name in {list(imports)!r}:\n"
            "    __import__(name)\n"
            "    loaded.append(sorted(sys.modules))\n"
            "print(json.dumps(loaded))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "examples")}).stdout
    return [set(names) for names in json.loads(out.splitlines()[-1])]


def _under(loaded: set[str], package: str) -> list[str]:
    return sorted(m for m in loaded if m == package or m.startswith(package + "."))


@pytest.mark.slow  # an interpreter start
def test_start_up_loads_neither_the_compiler_nor_the_fp8_stack_nor_the_kernels():
    # One interpreter for both checks (a start costs seconds on 2 cores). `import megatron_fsdp`
    # loads only what it exposes; the training loop and the example scripts (what every rank of
    # a job imports) leave torch's compiler (torch._dynamo: about 0.6 s per rank), the fp8 stack
    # and the extension's loader (its build check runs a child process) to the runs that use them.
    package, training, _, scripts = _loaded_after(PACKAGE, f"{PACKAGE}.training.training", "pretrain_gpt",
                                                  "generate_gpt")
    for unwanted in ("distributed", "training", "fp8", "kernels", "models", "transformer", "optimizer",
                     "dist_checkpointing", "datasets"):
        assert not _under(package, f"{PACKAGE}.{unwanted}"), (unwanted, sorted(package))
    for unwanted in ("torch._dynamo", "torch._inductor", f"{PACKAGE}.fp8", f"{PACKAGE}.kernels"):
        for what, loaded in (("the training loop", training), ("the example scripts", scripts)):
            assert not _under(loaded, unwanted), (what, unwanted, _under(loaded, unwanted))
    assert f"{PACKAGE}.distributed.fsdp_plan" in training  # the check looked at a real start-up
