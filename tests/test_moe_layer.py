"""MoELayer on one rank against the plain reference (tests/moe_reference.py): outputs, input and
weight gradients and the logged auxiliary losses, over the router's options, capacity and token
dropping, shared experts, padding, and both dispatchers; GroupedMLP against SequentialMLP; the
parameters' layout; meta-device initialization; refused inputs."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import moe_reference
from moe_cases import TOLERANCE, build, data, moe_config, run_and_compare, setup
from megatron_fsdp.transformer.moe import (GroupedMLP, MoELayer, SequentialMLP, get_moe_metrics_tracker,
                                           reduce_moe_metrics)

FEATURES = {
    "softmax_aux_z": dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01),
    "pre_softmax_scaled_gelu": dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5,
                                    gated_linear_unit=False, activation_func=F.gelu, moe_aux_loss_coeff=0.05),
    "sigmoid_bias_scaled": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                moe_router_topk_scaling_factor=1.5, moe_aux_loss_coeff=0.1),
    "sigmoid_top1": dict(moe_router_score_function="sigmoid", moe_router_topk=1, moe_z_loss_coeff=0.02),
    "softmax_top1_pre": dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.1),
    "capacity_probs": dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs", moe_aux_loss_coeff=0.1),
    "capacity_position": dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position"),
    "capacity_padded": dict(moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=True),
    "shared": dict(moe_shared_expert_intermediate_size=8, moe_z_loss_coeff=0.01),
    "shared_gated": dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True),
    "seq_aux": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.2),
    "fp64_router": dict(moe_router_dtype="fp64", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01),
    "fused_swiglu": dict(bias_activation_fusion=True, moe_aux_loss_coeff=0.1),
    "grouped_gemm": dict(moe_grouped_gemm=True, moe_aux_loss_coeff=0.1),
}
FAST = ("softmax_aux_z", "sigmoid_bias_scaled", "capacity_probs", "capacity_padded", "shared_gated", "seq_aux")


def _case_feature(name: str, dispatcher: str, padded: bool = False) -> None:
    setup()
    config = moe_config(moe_token_dispatcher_type=dispatcher, **FEATURES[name])
    result = run_and_compare(config, padded=padded)
    logged = {k: float(v) for k, v in reduce_moe_metrics(loss_scale=1.0, num_layers=1).items()}
    assert logged.keys() == result["logged"].keys(), (logged, result["logged"])
    for key, value in result["logged"].items():
        assert logged[key] == pytest.approx(value, rel=1e-5), key
    router = result["layer"].router
    if router.enable_expert_bias:
        assert router.local_tokens_per_expert.tolist() == result["tokens_per_expert"]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in FEATURES])
def test_layer_matches_reference(pools, name, dispatcher):
    pools(1).run(_case_feature, name, dispatcher)


@pytest.mark.parametrize("name", ["softmax_aux_z", "seq_aux", "sigmoid_bias_scaled"])
def test_padding_mask_leaves_padding_out_of_the_losses(pools, name):
    pools(1).run(_case_feature, name, "alltoall", padded=True)


def _case_eval_records_nothing() -> None:
    setup()
    config = moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True)
    layer = build(config, moe_reference.draw_weights(config))
    x, _, _ = data(config)
    layer.eval()
    reference = moe_reference.reference(config, moe_reference.draw_weights(config), x)
    torch.testing.assert_close(layer(x[0])[0], reference.output[0], **TOLERANCE)
    layer.train()
    with torch.no_grad():
        layer(x[0])
    assert not get_moe_metrics_tracker().metrics
    assert layer.router.local_tokens_per_expert.sum() == 0


def test_eval_and_no_grad_add_no_losses(pools):
    pools(1).run(_case_eval_records_nothing)


def _case_grouped_equals_sequential(force_grouped_mm: bool) -> None:
    setup()
    config = moe_config()
    if force_grouped_mm:  # torch._grouped_mm runs on the CPU too: the kernel path, checked here
        GroupedMLP._use_grouped_mm = lambda self, x, weight: True
    torch.manual_seed(3)
    grouped = GroupedMLP(4, config)
    torch.manual_seed(3)
    sequential = SequentialMLP(4, config)
    assert [n for n, _ in grouped.named_parameters()] == [n for n, _ in sequential.named_parameters()]
    for a, b in zip(grouped.parameters(), sequential.parameters()):
        assert torch.equal(a, b)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, config.hidden_size)
    probs = torch.rand(10)
    outputs, grads = [], []
    for experts in (grouped, sequential):
        xi = x.clone().requires_grad_(True)
        out, bias = experts(xi, counts, probs)
        assert bias is None
        out.sum().backward()  # an expanded gradient: the grouped kernel needs it made contiguous
        outputs.append(out)
        grads.append([xi.grad] + [p.grad for p in experts.parameters()])
    torch.testing.assert_close(outputs[0], outputs[1], **TOLERANCE)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **TOLERANCE)
    assert grads[1][1][1].abs().sum() == 0  # expert 1 had no tokens


@pytest.mark.parametrize("force_grouped_mm", [False, True])
def test_grouped_mlp_equals_sequential_mlp(pools, force_grouped_mm):
    pools(1).run(_case_grouped_equals_sequential, force_grouped_mm)


def _case_parameters_and_meta_init() -> None:
    from megatron_fsdp.initialization import initialize_parameters

    setup()
    config = moe_config(moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True,
                        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    layer = MoELayer(config, layer_number=1)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {"router.weight": (4, 16), "experts.linear_fc1.weight": (4, 2, 8, 16),
                      "experts.linear_fc2.weight": (4, 16, 8), "shared_experts.gate_weight": (1, 16),
                      "shared_experts.linear_fc1.weight": (16, 16), "shared_experts.linear_fc2.weight": (16, 8)}
    for name in ("experts.linear_fc1.weight", "experts.linear_fc2.weight"):
        p = layer.get_parameter(name)
        assert p.allreduce is False and not isinstance(p, DTensor)  # EP x expert TP = 1: plain
    assert layer.experts.is_expert and not getattr(layer.router, "is_expert", False)
    assert layer.router.expert_bias.dtype == torch.float32 and "router.expert_bias" in layer.state_dict()
    assert "router.local_tokens_per_expert" not in layer.state_dict()
    with torch.device("meta"):
        meta = MoELayer(config, layer_number=1)
    assert all(p.device.type == "meta" for p in meta.parameters())
    meta.to_empty(device="cpu")
    initialize_parameters(meta, seed=5)
    assert meta.router.expert_bias.abs().sum() == 0 and meta.router.local_tokens_per_expert.abs().sum() == 0
    for name, p in meta.named_parameters():
        assert p.std() > 0.01, name


def test_parameters_and_meta_device_init(pools):
    pools(1).run(_case_parameters_and_meta_init)


def _case_refused() -> None:
    setup()
    config = moe_config()
    layer = MoELayer(config, layer_number=1)
    x = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match=r"hidden_states must be \[s, b, 16\]"):
        layer(torch.randn(4, 16))
    with pytest.raises(ValueError, match=r"padding_mask must be \[b, s\] = \(2, 4\)"):
        layer(x, padding_mask=torch.zeros(4, 2, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="intermediate_tensors"):
        layer(x, intermediate_tensors=(x,))
    with pytest.raises(NotImplementedError, match="pg_collection"):
        MoELayer(config, pg_collection=object())
    with pytest.raises(ValueError, match="expert_model_parallel_size=2"):
        MoELayer(moe_config(expert_model_parallel_size=2))
    with pytest.raises(ValueError, match="bias_activation_fusion=True fuses SwiGLU only"):
        MoELayer(moe_config(bias_activation_fusion=True, activation_func=F.gelu))
    with pytest.raises(ValueError, match=r"tokens_per_expert \[1, 1, 1, 1\]"):
        layer.experts(torch.randn(3, 16), torch.tensor([1, 1, 1, 1]), torch.rand(3))


def test_bad_inputs_raise_one_clear_error(pools):
    pools(1).run(_case_refused)


def test_padding_to_a_capacity_above_the_tokens_is_refused():
    from megatron_fsdp.transformer import TransformerConfig

    fields = dict(num_layers=1, hidden_size=16, num_attention_heads=4, add_bias_linear=False, num_moe_experts=4,
                  moe_router_topk=2, moe_pad_expert_input_to_capacity=True)
    TransformerConfig(**fields, moe_expert_capacity_factor=2.0)  # capacity = a rank's tokens: allowed
    with pytest.raises(ValueError, match="the factor must be at most num_moe_experts / moe_router_topk = 2"):
        TransformerConfig(**fields, moe_expert_capacity_factor=2.5)
