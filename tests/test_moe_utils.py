"""transformer/moe/moe_utils.py and moe_logging.py against their formulas: the load-balancing and
z-losses, capacity and token dropping, permutation, the auxiliary-loss autograd scale, the
expert-bias update, and the aux-loss tracker's averaging (layers, micro-batches, ranks)."""

import math

import pytest
import torch
import torch.distributed as dist

import moe_reference
from moe_cases import build, data, moe_config, setup
from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.transformer.moe import MoEAuxLossAutoScaler, get_moe_metrics_tracker, reduce_moe_metrics
from megatron_fsdp.transformer.moe import moe_utils
from megatron_fsdp.transformer.moe.moe_logging import num_moe_layers, track_moe_metrics


def test_switch_load_balancing_loss_is_its_formula():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(6, 4, generator=g)
    counts = torch.tensor([5, 2, 4, 1])
    expected = sum(probs[:, e].sum() * counts[e] for e in range(4)) * 4 * 0.1 / (2 * 6 * 6)
    loss = moe_utils.switch_load_balancing_loss_func(probs, counts, 6, topk=2, num_experts=4, moe_aux_loss_coeff=0.1)
    torch.testing.assert_close(loss, expected)
    keep = torch.tensor([True, False, True, True, False, True])
    masked = moe_utils.switch_load_balancing_loss_func(probs, counts, 6, 2, 4, 0.1, padding_mask=keep)
    torch.testing.assert_close(masked, sum(probs[keep][:, e].sum() * counts[e] for e in range(4)) * 0.4 / 72)


def test_z_loss_is_its_formula():
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    squares = [math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()]
    torch.testing.assert_close(moe_utils.z_loss_func(logits, 0.5), torch.tensor(sum(squares) / 5 * 0.5))
    padding = torch.tensor([False, True, False, False, True])
    kept = [s for s, p in zip(squares, padding.tolist()) if not p]
    torch.testing.assert_close(moe_utils.z_loss_func(logits, 0.5, padding), torch.tensor(sum(kept) / 3 * 0.5))


def test_capacity_and_token_dropping():
    assert moe_utils.get_capacity(num_tokens=10, num_experts=4, capacity_factor=1.0) == 3
    assert moe_utils.get_capacity(10, 4, 0.1, min_capacity=2) == 2
    probs = torch.tensor([[0.6, 0.4, 0.0], [0.7, 0.0, 0.3], [0.5, 0.0, 0.5], [0.9, 0.0, 0.1]])
    routing_map = probs > 0
    # capacity = ceil(4 tokens x top-2 / 3 experts x 0.5) = 2: experts 0 and 2 have more tokens.
    by_probs, map_probs = moe_utils.apply_router_token_dropping(probs, routing_map, 2, 0.5, "probs")
    assert map_probs.T.tolist() == [[False, True, False, True], [True, False, False, False],
                                    [False, True, True, False]]  # the largest weights
    assert torch.equal(by_probs, probs * map_probs)
    _, map_position = moe_utils.apply_router_token_dropping(probs, routing_map, 2, 0.5, "position")
    assert map_position.T.tolist() == [[True, True, False, False], [True, False, False, False],
                                       [False, True, True, False]]  # the earliest tokens
    by_padded, padded = moe_utils.apply_router_token_dropping(probs, routing_map, 2, 0.5, "position",
                                                              pad_to_capacity=True)
    assert padded.T.tolist() == [[True, True, False, False], [True, True, False, False],
                                 [False, True, True, False]]  # exactly 2 each: routed first, then the earliest
    assert by_padded[1, 1] == 0  # a padding entry weighs nothing
    with pytest.raises(ValueError, match="drop_policy must be 'probs' or 'position'"):
        moe_utils.apply_router_token_dropping(probs, routing_map, 2, 0.5, "random")


def test_topk_routing_refuses_what_it_does_not_build():
    with pytest.raises(NotImplementedError, match="group-limited"):
        moe_utils.topk_routing_with_score_function(torch.zeros(2, 4), 2, num_groups=2, group_topk=1)
    with pytest.raises(ValueError, match="score_function must be"):
        moe_utils.topk_routing_with_score_function(torch.zeros(2, 4), 2, score_function="sqrtsoftplus")


def test_permute_groups_tokens_by_expert_and_unpermute_sums_them_back():
    tokens = torch.arange(12.0).view(4, 3)
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    probs = torch.rand(4, 3) * routing_map
    permuted, permuted_probs, rows = moe_utils.permute(tokens, routing_map, probs, num_out_tokens=7)
    expected_rows = [t for e in range(3) for t in range(4) if routing_map[t, e]]
    assert rows.tolist() == expected_rows == [0, 2, 1, 2, 0, 1, 3]
    assert torch.equal(permuted, tokens[expected_rows])
    assert permuted_probs.tolist() == [probs[t, e].item() for e in range(3) for t in range(4) if routing_map[t, e]]
    restored = moe_utils.unpermute(permuted, rows, tokens.shape)
    torch.testing.assert_close(restored, tokens * routing_map.sum(dim=1, keepdim=True))
    weighted = moe_utils.unpermute(permuted, rows, tokens.shape, probs=probs, routing_map=routing_map)
    torch.testing.assert_close(weighted, tokens * probs.sum(dim=1, keepdim=True))
    chunks, chunk_probs = moe_utils.sort_chunks_by_idxs(permuted, [2, 3, 2], [2, 0, 1], probs=permuted_probs)
    assert torch.equal(chunks, permuted[[5, 6, 0, 1, 2, 3, 4]])
    assert torch.equal(chunk_probs, permuted_probs[[5, 6, 0, 1, 2, 3, 4]])


def test_aux_loss_autoscaler_scales_only_the_aux_loss_gradient():
    try:
        for scale in (1.0, 3.0):
            MoEAuxLossAutoScaler.set_loss_scale(scale)
            w = torch.tensor([2.0], requires_grad=True)
            out = MoEAuxLossAutoScaler.apply(w * 5, (w ** 2).sum())
            out.sum().backward()
            assert w.grad.item() == 5 + scale * 4
    finally:
        MoEAuxLossAutoScaler.set_loss_scale(1.0)


def test_counting_moe_layers():
    assert num_moe_layers(4, 1) == 4 and num_moe_layers(4, 2) == 2 and num_moe_layers(5, 2) == 3
    assert num_moe_layers(4, [0, 1, 1, 0]) == 2


def _case_tracker_averages_layers_micro_batches_and_ranks() -> None:
    """Megatron's track_moe_metrics arithmetic: a loss (reduce group: summed over TP) averaged
    over DP, times loss_scale, summed over layers / MoE layers; z_loss averaged over all ranks."""
    setup(tp=2)
    tracker = get_moe_metrics_tracker()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    world = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    rank = dist.get_rank()
    for micro_batch in range(2):  # two micro-batches, layers 1 and 3 of 4 (moe_layer_freq 2)
        for layer in (1, 3):
            value = torch.tensor(float(rank + 10 * layer + 100 * micro_batch))
            tracker.record("load_balancing_loss", value, layer, 4, reduce_group=tp_group)
            tracker.record("z_loss", value, layer, 4, avg_group=world)
    totals = {}
    line = track_moe_metrics(loss_scale=0.5, iteration=1, total_loss_dict=totals, num_layers=4, moe_layer_freq=2)
    # Per (layer, micro-batch) on rank r: r + 10 l + 100 m. Summed over the TP pair (r, r+1 of the
    # same DP rank: 2r' + 1 + 2 (10 l + 100 m)), averaged over DP (ranks 0-1 and 2-3: mean 2 + ...).
    mean_tp_sum = (1 + 5) / 2
    expected_lb = sum(mean_tp_sum + 2 * (10 * layer + 100 * m) for layer in (1, 3) for m in (0, 1)) * 0.5 / 2
    expected_z = sum(1.5 + 10 * layer + 100 * m for layer in (1, 3) for m in (0, 1)) * 0.5 / 2
    assert totals == pytest.approx({"load_balancing_loss": expected_lb, "z_loss": expected_z})
    assert line == ""
    assert all(e.values.abs().sum() == 0 for e in tracker.metrics.values())  # cleared
    reduced = reduce_moe_metrics(loss_scale=1.0, num_layers=4, moe_layer_freq=2)  # device tensors: no sync
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in reduced.values())
    assert {k: float(v) for k, v in reduced.items()} == {"load_balancing_loss": 0.0, "z_loss": 0.0}


def test_tracker_averages_layers_micro_batches_and_ranks(pools):
    pools(4).run(_case_tracker_averages_layers_micro_batches_and_ranks)


def _case_aux_loss_scale_and_recompute() -> None:
    """set_loss_scale scales the auxiliary losses' share of the gradients; a checkpointed
    (recomputed) layer gives the same gradients, logs its losses and counts its tokens once."""
    setup()
    config = moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True)
    weights = moe_reference.draw_weights(config)
    x, grad_out, _ = data(config)

    def run(scale: float, checkpointed: bool = False, coefficients: bool = True):
        cfg = config if coefficients else moe_config(moe_router_score_function="sigmoid",
                                                     moe_router_enable_expert_bias=True)
        layer = build(cfg, weights)
        MoEAuxLossAutoScaler.set_loss_scale(scale)
        xi = x[0].clone().requires_grad_(True)
        out = (tensor_parallel.checkpoint(lambda h: layer(h)[0], False, xi) if checkpointed else layer(xi)[0])
        (out * grad_out[0]).sum().backward()
        logged = {k: float(v) for k, v in reduce_moe_metrics(loss_scale=1.0, num_layers=1).items()}
        return layer.router.weight.grad, logged, layer.router.local_tokens_per_expert.clone()

    main_only, _, _ = run(1.0, coefficients=False)
    once, logged, counts = run(1.0)
    thrice, _, _ = run(3.0)
    torch.testing.assert_close(thrice - main_only, 3 * (once - main_only), rtol=1e-5, atol=1e-5)
    recomputed, logged_again, counts_again = run(1.0, checkpointed=True)
    torch.testing.assert_close(recomputed, once, rtol=1e-6, atol=1e-6)
    assert logged_again == pytest.approx(logged) and torch.equal(counts_again, counts)
    MoEAuxLossAutoScaler.set_loss_scale(1.0)


def test_aux_loss_scale_and_recomputation(pools):
    pools(1).run(_case_aux_loss_scale_and_recompute)
