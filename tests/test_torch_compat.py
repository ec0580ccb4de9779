"""megatron_fsdp/_torch_compat.py: every private torch name the package uses,
pinned on the running torch, and nobody else reaching into torch's privates.

The main job once died on torch 2.11 because FSDP2's per-module state is
named differently there (`_fsdp_param_group`, not `_fsdp_param_groups`); these
tests make such a difference fail here, by name, on whatever torch CI runs
(torch 2.13 CPU, and the CUDA torch of the second run), and check the
version-specific branches on every torch with stand-ins for the other shape.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import types

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp import _torch_compat

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _resolve(spec: str):
    module_name, _, path = spec.partition(":")
    obj = importlib.import_module(module_name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_running_torch_is_supported():
    assert _torch_compat.torch_is_supported(), (
        f"torch {torch.__version__} is outside {_torch_compat.supported_torch_range()}")


@pytest.mark.parametrize("version, supported", [
    ("2.10.0", False), ("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", True), ("2.14.1+cu130", True),
    ("2.15.0a0+git123", False), ("3.0.0", False)])
def test_supported_range(version, supported):
    assert _torch_compat.torch_is_supported(version) is supported


@pytest.mark.parametrize("spec", sorted(_torch_compat.PRIVATE_NAMES))
def test_private_name_exists_on_this_torch(spec):
    versions = _torch_compat.PRIVATE_NAMES[spec]
    if versions is not None and not versions[0] <= _torch_compat.torch_version() < versions[1]:
        pytest.skip(f"{spec} is only used on torch {versions}")
    if spec in _torch_compat.CUDA_BUILD_ONLY and torch.version.cuda is None:
        pytest.skip(f"{spec} exists in CUDA builds of torch only")
    assert _resolve(spec) is not None


def test_fsdp_copy_op_schemas_match_this_torch():
    for name, expected in _torch_compat.FSDP_COPY_OP_SCHEMAS.items():
        assert _torch_compat.fsdp_copy_op_schema(name) == expected


def test_fsdp_param_groups_reads_either_state_layout():
    # torch 2.11: one group or None under `_fsdp_param_group`; 2.12+: a list.
    group = object()
    for state, expected in [
        (types.SimpleNamespace(_fsdp_param_group=group), [group]),
        (types.SimpleNamespace(_fsdp_param_group=None), []),
        (types.SimpleNamespace(_fsdp_param_groups=[group, group]), [group, group]),
    ]:
        module = types.SimpleNamespace(_get_fsdp_state=lambda state=state: state)
        assert _torch_compat.fsdp_param_groups(module) == expected


def _case_local_tensor_is_the_object_fsdp_holds():
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    param = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [Replicate()]))
    # to_local() returns a fresh view for a Parameter on torch >= 2.13; we need the object.
    assert _torch_compat.local_tensor(param) is param._local_tensor
    plain = torch.randn(3)
    assert _torch_compat.local_tensor(plain) is plain
    return True


def test_local_tensor_is_the_object_fsdp_holds(pools):
    assert pools(2).run(_case_local_tensor_is_the_object_fsdp_holds) == [True, True]


def _case_fsdp_state_on_a_live_module():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # The pool is gloo on the CPU: without a mesh FSDP2 takes the accelerator's (a CUDA mesh on a GPU machine).
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    groups = [g for m in model.modules() for g in _torch_compat.fsdp_param_groups(m) if hasattr(m, "unshard")]
    assert len(groups) == 2  # the root owns no parameter: no group
    params = list(_torch_compat.fsdp_params(model))
    assert len(params) == 4

    # A backward without reduce-scatter: FSDP2 holds unsharded gradients until dropped.
    model.set_requires_gradient_sync(False)
    model(torch.randn(2, 8)).float().sum().backward()
    for fsdp_param in params:
        for name in _torch_compat.FSDP_PRIVATE_ATTRIBUTES["param"]:
            if name != "_sharded_post_forward_param_data":  # made by resharding to a smaller group only
                assert hasattr(fsdp_param, name), name
        assert _torch_compat.casts_in_copy_in(fsdp_param)
        assert _torch_compat.all_gather_source(fsdp_param).numel() == fsdp_param.sharded_size.numel()
    assert not _torch_compat.compiled_autograd_enabled()
    assert all(_torch_compat.unsharded_grads(p) for p in params)
    for fsdp_param in params:
        _torch_compat.drop_unsharded_grads(fsdp_param)
    assert not any(_torch_compat.unsharded_grads(p) for p in params)
    return True


def test_fsdp_state_on_a_live_module(pools):
    assert pools(2).run(_case_fsdp_state_on_a_live_module) == [True, True]


# Attribute names that only torch's internals carry (looked for on any object).
_PRIVATE_ATTRIBUTES = {name for names in _torch_compat.FSDP_PRIVATE_ATTRIBUTES.values() for name in names
                       if name.startswith("_") and " " not in name} | {
    "_fsdp_param_groups", "_fsdp_param_group", "_get_fsdp_state", "_flatten", "_get_default_group",
    "_get_default_store", "_set_pg_timeout", "_make_wrapper_subclass", "_disabled_torch_function_impl",
    *_torch_compat.ALL_GATHER_INPUT_FUNCTIONS,
    # nn.Module's and the dispatcher's own state (public API exists for what we need of it)
    "_parameters", "_buffers", "_modules", "_schema", "_register_state_dict_hook",
    "_register_load_state_dict_pre_hook", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
    "_state_dict_hooks", "_load_state_dict_pre_hooks"}
_TORCH_ALIASES = {"torch", "dist", "F", "nn", "fsdp", "c10d"}


def _private_uses(path: pathlib.Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            private = [p for p in node.module.split(".") if p.startswith("_")]
            private += [a.name for a in node.names if a.name.startswith("_")]
            if private:
                found.append(f"{where}: from {node.module} import {private}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and any(p.startswith("_") for p in alias.name.split(".")):
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            rooted = isinstance(base, ast.Name) and base.id in _TORCH_ALIASES
            if node.attr in _PRIVATE_ATTRIBUTES or (
                    rooted and any(p.startswith("_") and not p.startswith("__") for p in chain)):
                found.append(f"{where}: .{'.'.join(reversed(chain))}")
    return found


def test_assume_constant_result_marks_what_torchs_decorator_marks():
    # Ours sets one attribute without importing the compiler; torch's decorator must set that
    # attribute, and only it, or compiled graphs would trace the loader again.
    def ours():
        return True

    def torchs():
        return True

    assert _torch_compat.assume_constant_result(ours) is ours
    assert torch.compiler.assume_constant_result(torchs) is torchs
    assert vars(torchs) == vars(ours) == {_torch_compat.DYNAMO_CONSTANT_RESULT_ATTRIBUTE: True}


def test_no_private_torch_names_outside_the_compat_module():
    sources = [p for d in ("megatron_fsdp", "examples", "benchmarks", "tools") for p in (ROOT / d).rglob("*.py")]
    sources.append(ROOT / "setup.py")
    sources = [p for p in sources if p.name != "_torch_compat.py"]
    found = [use for path in sources for use in _private_uses(path)]
    assert not found, "private torch names outside megatron_fsdp/_torch_compat.py:\n" + "\n".join(found)


def test_the_scan_sees_what_it_looks_for(tmp_path):
    # The scan above must not pass by looking at nothing.
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nimport torch.distributed as dist\n"
                      "from torch.distributed.fsdp._fully_shard import _fsdp_collectives\n"
                      "x = dist.distributed_c10d._get_default_group()\n"
                      "y = weight._local_tensor\n"
                      "z = torch._scaled_mm\n"
                      "w = linear._parameters['weight']\n"
                      "ok = torch.__version__\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        uses = _private_uses(sample)
    finally:
        ROOT = saved
    assert len(uses) == 5, uses
