"""MoELayer across ranks against the plain reference (tests/moe_reference.py): expert parallelism,
with data parallelism, with tensor + sequence parallelism at expert TP 1 and 2, with context
parallelism, both dispatchers.
Each rank's output and input gradient are the reference's on its tokens; the full weight
gradients (summed over the ranks that share them) are the reference's; so are the logged
losses and the expert-bias token counts and update. The experts' full weights are the same at
every EP / expert-TP size."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from helpers import tiered
from moe_cases import moe_config, run_and_compare, setup
from megatron_fsdp import parallel_state
from megatron_fsdp.initialization import initialize_parameters
from megatron_fsdp.transformer.moe import MoELayer, reduce_moe_metrics
from megatron_fsdp.transformer.moe.moe_utils import _update_router_expert_bias, reset_model_temporary_tensors

# (world, TP, EP, expert TP, CP): TP > 1 runs with sequence parallelism.
LAYOUTS = [(2, 1, 2, 1, 1), (4, 1, 2, 1, 1), (4, 2, 2, 1, 1), (4, 2, 2, 2, 1), (4, 1, 4, 1, 1), (4, 2, 1, 2, 1),
           (4, 1, 2, 1, 2), (4, 2, 2, 2, 2)]
FEATURES = {
    "losses_shared": dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_shared_expert_intermediate_size=8,
                          moe_shared_expert_gate=True),
    "capacity_seq_aux": dict(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="seq_aux_loss",
                             moe_aux_loss_coeff=0.1),
    "padded_capacity": dict(moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=True,
                            moe_token_drop_policy="position"),
    "sigmoid_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_bias_update_rate=0.01, moe_z_loss_coeff=0.01),
}
CASES = [(layout, dispatcher, feature) for layout in LAYOUTS for dispatcher in ("alltoall", "allgather")
         for feature in FEATURES]
FAST = [((2, 1, 2, 1, 1), "alltoall", "losses_shared"), ((4, 2, 2, 2, 1), "alltoall", "losses_shared"),
        ((4, 2, 2, 1, 1), "allgather", "capacity_seq_aux"), ((4, 1, 2, 1, 1), "alltoall", "sigmoid_bias"),
        ((4, 2, 2, 2, 1), "alltoall", "padded_capacity"), ((4, 1, 2, 1, 2), "allgather", "losses_shared")]


def _check_logged(expected: dict) -> None:
    logged = {k: float(v) for k, v in reduce_moe_metrics(loss_scale=1.0, num_layers=1).items()}
    assert logged.keys() == expected.keys(), (logged, expected)
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=1e-5), key


def _check_expert_bias(layer, config, counts: list[int]) -> None:
    """The counts summed over ranks are the reference's; the update is Megatron's formula."""
    router = layer.router
    before = router.expert_bias.clone()
    summed = router.local_tokens_per_expert.clone()
    dist.all_reduce(summed)
    assert summed.tolist() == counts
    _update_router_expert_bias([layer], config)
    counts = torch.tensor(counts, dtype=torch.float32)
    expected = before + config.moe_router_bias_update_rate * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(router.expert_bias, expected, rtol=0, atol=0)
    reset_model_temporary_tensors(config, [layer])
    assert router.local_tokens_per_expert.abs().sum() == 0


def _case_layout(layout, dispatcher: str, feature: str) -> None:
    _, tp, ep, etp, cp = layout
    setup(tp, ep, etp, cp=cp)
    config = moe_config(moe_token_dispatcher_type=dispatcher, **FEATURES[feature])
    result = run_and_compare(config)
    _check_logged(result["logged"])
    if config.moe_router_enable_expert_bias:
        _check_expert_bias(result["layer"], config, result["tokens_per_expert"])


@pytest.mark.parametrize("layout, dispatcher, feature", tiered(CASES, FAST))
def test_layer_across_ranks_matches_reference(pools, layout, dispatcher, feature):
    pools(layout[0]).run(_case_layout, layout, dispatcher, feature)


def _case_expert_placements() -> None:
    """Experts' parameters at EP 2 x expert TP 2: DTensors on the (ep, etp) mesh, experts over EP,
    F over expert TP; full weights the same as at EP 1, 2 and 4, eager and meta-initialized."""
    eager, meta = {}, {}
    for ep, etp in ((1, 1), (2, 1), (4, 1), (2, 2), (1, 4)):
        setup(1, ep, etp, seed=77)
        config = moe_config()
        layer = MoELayer(config, layer_number=1)
        for name in ("linear_fc1", "linear_fc2"):
            p = getattr(layer.experts, name).weight
            if ep * etp > 1:
                assert isinstance(p, DTensor) and tuple(p.placements) == (Shard(0), Shard(2))
                assert p.device_mesh == parallel_state.get_expert_model_parallel_mesh()
                assert p.to_local().shape[0] == 4 // ep and p.to_local().shape[2] == 8 // etp
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            eager.setdefault(name, full)
            torch.testing.assert_close(full, eager[name], rtol=0, atol=0)
        with torch.device("meta"):
            on_meta = MoELayer(config, layer_number=1)
        on_meta.to_empty(device="cpu")
        initialize_parameters(on_meta, seed=9)
        for name, p in on_meta.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            meta.setdefault(name, full)
            torch.testing.assert_close(full, meta[name], rtol=0, atol=0)
        parallel_state.destroy_model_parallel()


def test_expert_weights_are_the_same_at_every_layout(pools):
    pools(4).run(_case_expert_placements)
