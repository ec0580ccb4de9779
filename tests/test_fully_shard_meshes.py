"""`fully_shard` on a user's DeviceMesh: HSDP, HFSDP (the optimizer sharded across the outer
dimension too), tensor parallelism with FSDP and with no_shard. Four gloo ranks; the reference
is one process training the same model on every data-parallel rank's data (fully_shard_models)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from megatron_fsdp import MixedPrecisionPolicy, fully_shard, fully_shard_model
from megatron_fsdp.optimizer.clip_grads import get_grad_norm_fp32

from fully_shard_models import (STEPS, EncoderStack, SmallCNN, TwoLayerMLP, adam_run, assert_like_one_process, batch,
                                gathered, loss_of, train_like_one_process)


def _hybrid(outer_strategy="no_shard"):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "shard"))
    return dict(device_mesh=mesh, dp_shard_dim="shard", dp_outer_dim="outer", hybrid_fsdp_group=dist.group.WORLD,
                outer_dp_sharding_strategy=outer_strategy)


def _optimizer_share(model, opt):
    """The fraction of the model's elements this rank's optimizer steps (its parameters' local
    elements), and whether those are the model's own parameters."""
    held = [p for group in opt.param_groups for p in group["params"]]
    full = sum(p.numel() for p in model.module.parameters())
    own = {id(p) for p in model.module.parameters()}
    return sum(p.to_local().numel() for p in held) / full, all(id(p) in own for p in held)


def _case_hybrid(model_name, strategy, outer_strategy, comm_dtype=None):
    policy = MixedPrecisionPolicy(grad_comm_dtype=comm_dtype)
    model, opt = train_like_one_process(model_name, strategy, mixed_precision_policy=policy, **_hybrid(outer_strategy))
    share, own = _optimizer_share(model, opt)
    weights = sum(p.to_local().numel() for p in model.module.parameters()) / sum(
        p.numel() for p in model.module.parameters())
    return model.data_parallel_sharding_strategy, model.device_mesh.ndim, round(weights, 1), round(share, 2), own


@pytest.mark.parametrize("model_name, strategy, outer, comm_dtype, expected", [
    # HSDP: each replica holds half of the model (2 shard ranks), and so does its optimizer.
    ("encoder", 3, "no_shard", None, ("optim_grads_params", 2, 0.5, 0.5, True)),
    pytest.param("cnn", "no_shard", 0, None, ("no_shard", 2, 1.0, 1.0, True), marks=pytest.mark.slow),
    # HFSDP: the weights are halves, the optimizer steps a quarter (its pieces of the halves);
    # gradients reduced in another dtype than the parameters' (grad_comm_dtype) too.
    pytest.param("encoder", 3, "optim", None, ("optim_grads_params", 2, 0.5, 0.25, False), marks=pytest.mark.slow),
    pytest.param("cnn", "optim_grads", 1, torch.float64, ("optim_grads", 2, 0.5, 0.25, False),
                 marks=pytest.mark.slow),
])
def test_hybrid_meshes_train_like_one_process(pools, model_name, strategy, outer, comm_dtype, expected):
    results = pools(4).run(_case_hybrid, model_name, strategy, outer, comm_dtype)
    for got in results:  # shards are whole rows: the cnn's small tensors split a little unevenly
        assert got[:3] == expected[:3] and got[3] == pytest.approx(expected[3], abs=0.05) and got[4] == expected[4]


def _case_hfsdp_gradient_norm():
    """After finish_grad_sync the optimizer's parameters hold the gradient, and its norm over
    them is the one-process norm (ours and torch's clip_grad_norm_ alike)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = EncoderStack()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    model, opt = fully_shard(module, opt, fsdp_unit_modules=[nn.TransformerEncoderLayer], **_hybrid("optim"))
    loss_of(model, *batch("encoder", 0, rank)).backward()
    model.finish_grad_sync()
    held = [p for group in opt.param_groups for p in group["params"]]
    assert all(p.grad is None for p in model.module.parameters())  # moved into the pieces
    ours = get_grad_norm_fp32([p.grad for p in held])
    torchs = torch.nn.utils.clip_grad_norm_(held, max_norm=1e9)
    model.scale_gradients(0.5)  # as finalize_model_grads does after finish_grad_sync
    halved = get_grad_norm_fp32([p.grad for p in held])
    torch.manual_seed(0)
    reference = EncoderStack()
    batches = [batch("encoder", 0, r) for r in range(world)]
    loss_of(reference, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()
    torchs = torchs.full_tensor() if isinstance(torchs, DTensor) else torchs
    assert ours == pytest.approx(expected, rel=1e-5) and torchs.item() == pytest.approx(expected, rel=1e-5)
    assert halved == pytest.approx(expected / 2, rel=1e-5)


@pytest.mark.slow  # a pool case; HFSDP's representative: the quarter of the state below
def test_hfsdp_gradient_norm_over_the_optimizers_parameters_is_the_whole_models(pools):
    pools(4).run(_case_hfsdp_gradient_norm)


def _case_hfsdp_checkpoint(tmp):
    uninterrupted = adam_run(None, 3, **_hybrid("optim"))
    adam_run(f"{tmp}/hfsdp", 2, **_hybrid("optim"))
    adam_run(f"{tmp}/hsdp", 2, **_hybrid("no_shard"))
    # Saved after 2 steps, loaded into a differently seeded model and optimizer, one more step:
    # the uninterrupted run's parameters. The optimizer state is saved in the parameters'
    # layout, so HSDP and HFSDP load each other's checkpoints.
    for saved, outer in (("hfsdp", "optim"), ("hsdp", "optim"), ("hfsdp", "no_shard")):
        resumed = adam_run(None, 3, resume_from=f"{tmp}/{saved}", seed=123, **_hybrid(outer))
        for a, b in zip(resumed, uninterrupted):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=f"{saved} into {outer}")


@pytest.mark.slow  # a pool case; HFSDP's representative: the quarter of the state below
def test_hfsdp_checkpoint_round_trip_continues_training_and_hsdp_reads_it_and_back(pools, tmp_path):
    pools(4).run(_case_hfsdp_checkpoint, str(tmp_path))


def _case_hfsdp_gradient_lifecycle():
    """A reduction per microbatch (finish_grad_sync after each backward) adds up; a step skipped
    after finish_grad_sync (as on an overflow) and the optimizer's zero_grad leave nothing for the
    next step; training then equals the one-process run with two microbatches per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = EncoderStack()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    model, opt = fully_shard(module, opt, fsdp_unit_modules=[nn.TransformerEncoderLayer], **_hybrid("optim"))
    loss_of(model, *batch("encoder", 99, rank)).backward()  # the skipped step
    model.finish_grad_sync()
    opt.zero_grad()
    for step in range(STEPS):
        for microbatch in range(2):
            loss_of(model, *batch("encoder", 2 * step + microbatch, rank)).backward()
            model.finish_grad_sync()
        opt.step()
        opt.zero_grad()
    assert_like_one_process(model, "encoder", world, microbatches=2)


@pytest.mark.slow  # a pool case; HFSDP's representative: the quarter of the state below
def test_hfsdp_reduces_every_microbatch_and_a_skipped_step_leaves_nothing_behind(pools):
    pools(4).run(_case_hfsdp_gradient_lifecycle)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 5), nn.Linear(8, 5)

    def forward(self, x, use_b):
        h = torch.relu(self.body(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def _case_hfsdp_a_parameter_unused_on_one_replica():
    """Head b runs on the first outer replica's data only: its gradient exists there and not on
    the other replica, which must still take part and step it (the one-process reference)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    use_b = lambda r: r // 2 == 0  # noqa: E731  (the outer coordinate of rank r on the 2 x 2 mesh)
    torch.manual_seed(0)
    module = TwoHeads()
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    model, opt = fully_shard(module, opt, **_hybrid("optim"))
    torch.manual_seed(0)
    reference = TwoHeads()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        x, y = batch("encoder", step, rank)
        nn.functional.cross_entropy(model(x[:, 0], use_b(rank)), y).backward()
        opt.step()
        opt.zero_grad()
        losses = [nn.functional.cross_entropy(reference(batch("encoder", step, r)[0][:, 0], use_b(r)),
                                              batch("encoder", step, r)[1]) for r in range(world)]
        (sum(losses) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(gathered(p).detach(), q.detach(), atol=1e-6, rtol=1e-6, msg=name)


def test_hfsdp_steps_a_parameter_that_has_a_gradient_on_one_replica_only(pools):
    pools(4).run(_case_hfsdp_a_parameter_unused_on_one_replica)


def _case_hfsdp_model_moved_after_sharding():
    torch.manual_seed(0)
    module = SmallCNN()
    model, opt = fully_shard(module, torch.optim.SGD(module.parameters(), lr=0.1), fsdp_unit_modules=[nn.Sequential],
                             **_hybrid("optim"))
    model.module.to(torch.float64)
    loss_of(model, batch("cnn", 0, 0)[0].double(), batch("cnn", 0, 0)[1]).backward()
    opt.step()


def test_hfsdp_refuses_a_model_reallocated_after_sharding_on_every_rank(pools):
    errors = pools(4).run_expecting_errors(_case_hfsdp_model_moved_after_sharding)
    assert all(e.type_name == "RuntimeError" and "were reallocated after fully_shard" in e.message
               for e in errors), errors


def _case_hfsdp_memory():
    """Bytes this rank holds between steps (fp32): weights, the optimizer's gradients, Adam's moments."""
    torch.manual_seed(0)
    module = EncoderStack()
    full = sum(p.numel() for p in module.parameters()) * 4
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    model, opt = fully_shard(module, opt, fsdp_unit_modules=[nn.TransformerEncoderLayer], **_hybrid("optim"))
    loss_of(model, *batch("encoder", 0, dist.get_rank())).backward()
    opt.step()
    local = lambda ts: sum(t.to_local().numel() * 4 for t in ts if t is not None)  # noqa: E731
    held = [p for group in opt.param_groups for p in group["params"]]
    moments = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return (full, local(model.module.parameters()), local(p.grad for p in model.module.parameters()),
            local(p.grad for p in held), local(moments))


def test_hfsdp_holds_a_quarter_of_the_optimizer_state_and_gradients_on_a_2x2_mesh(pools):
    for full, weights, model_grads, grads, moments in pools(4).run(_case_hfsdp_memory):
        assert weights == pytest.approx(full / 2, rel=0.1)  # sharded over the inner dimension only
        assert model_grads == 0  # reduced into the optimizer's pieces, then dropped
        assert grads == pytest.approx(full / 4, rel=0.1) and moments == pytest.approx(2 * full / 4, rel=0.1)


def _case_hfsdp_needs_its_optimizer():
    model = fully_shard_model(SmallCNN(), fsdp_unit_modules=[nn.Sequential], **_hybrid("optim"))
    model(torch.randn(2, 3, 6, 6))


def test_hfsdp_without_fully_shard_optimizer_stops_at_the_first_forward_on_every_rank(pools):
    errors = pools(4).run_expecting_errors(_case_hfsdp_needs_its_optimizer)
    assert all(e.type_name == "RuntimeError" and "must step the outer shards" in e.message for e in errors), errors


def _case_tp(strategy, dims):
    """TwoLayerMLP with Megatron's column- then row-parallel blocks on the tensor-parallel
    dimension of a `dims` mesh (data-parallel dimensions first), trained against one process on
    every data-parallel rank's batch. Returns the parameters' mesh dimensions."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = tuple(dims)
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=names)
    dp_rank, dp = dist.get_rank() // dims["tp"], dist.get_world_size() // dims["tp"]  # tp is the last dimension
    torch.manual_seed(0)
    module = TwoLayerMLP()
    for block in module.blocks:
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    # (With one shard rank, the outer dimension's group holds every data-parallel rank.)
    kwargs = dict(dp_outer_dim="outer", hybrid_fsdp_group=mesh["outer"].get_group(),
                  outer_dp_sharding_strategy="optim") if "outer" in names else {}
    model, opt = fully_shard(module, opt, device_mesh=mesh, dp_shard_dim=names[-2], tp_dim="tp",
                             fsdp_unit_modules=[nn.Sequential], zero_dp_strategy=strategy, **kwargs)
    data = lambda step, r: (torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + r)),  # noqa: E731
                            torch.randint(0, 5, (4,), generator=torch.Generator().manual_seed(100 * step + r)))
    norms, expected_norms = [], []
    for step in range(STEPS):
        x, y = data(step, dp_rank)  # the same batch on both TP ranks of a data-parallel rank
        nn.functional.cross_entropy(model(x), y).backward()
        model.finish_grad_sync()  # the gradient norm over the optimizer's parameters (HFSDP: its pieces)
        norms.append(get_grad_norm_fp32([p.grad for g in opt.param_groups for p in g["params"]]))
        opt.step()
        opt.zero_grad()
    torch.manual_seed(0)
    reference = TwoLayerMLP()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        batches = [data(step, r) for r in range(dp)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        nn.functional.cross_entropy(reference(x), y).backward()
        expected_norms.append(get_grad_norm_fp32([p.grad for p in reference.parameters()]))
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(gathered(p).detach(), q.detach(), atol=1e-5, rtol=1e-5, msg=name)
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    linear = model.module.blocks[0][0].weight
    return linear.device_mesh.mesh_dim_names, linear.to_local().numel() * 2 == linear.numel()


@pytest.mark.parametrize("strategy, dims, expected", [
    (3, {"dp": 2, "tp": 2}, (("dp", "tp"), False)),  # FSDP x TP: a quarter of each weight
    pytest.param(0, {"dp": 2, "tp": 2}, (("dp_replicate", "dp_shard", "tp"), True),  # no_shard x TP: the TP half
                 marks=pytest.mark.slow),
    pytest.param(3, {"outer": 2, "shard": 1, "tp": 2}, (("shard", "tp"), True),  # HFSDP x TP (one shard rank)
                 marks=pytest.mark.slow),
], ids=["fsdp", "no_shard", "hfsdp"])
def test_tensor_parallel_dtensors_compose_with_each_data_parallel_strategy(pools, strategy, dims, expected):
    assert pools(4).run(_case_tp, strategy, dims) == [expected] * 4


def _case_no_shard_mesh_order():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    fully_shard_model(SmallCNN(), device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp", zero_dp_strategy=0)


def test_no_shard_with_tensor_parallelism_wants_the_data_parallel_dimensions_first(pools):
    errors = pools(4).run_expecting_errors(_case_no_shard_mesh_order)
    assert all(e.type_name == "ValueError" and "its dimensions must be ('dp', 'tp')" in e.message
               for e in errors), errors
