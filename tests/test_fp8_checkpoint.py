"""fp8 training with fp8 weight all-gather and MegatronOptimizer, checkpoints
across fp8 and high precision: a GPT at TP=2 x DP=2 under raw fully_shard,
saved and loaded with training.checkpointing."""

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from helpers import full_tensor, make_config, on_rank_zero, rewrite_as_format_2, setup_parallel
from megatron_fsdp import _torch_compat, parallel_state, tensor_parallel
from megatron_fsdp.dist_checkpointing import torch_dcp
from megatron_fsdp.fp8 import (
    Fp8GatheredWeight,
    convert_to_fp8,
    convert_to_fp8_weights,
    fp8_state_dict,
    refresh_fp8_scales,
)
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.training.checkpointing import export_safetensors, load_checkpoint, save_checkpoint

TP = 2
VOCAB, SEQ, MICRO = 64, 16, 2
FP8_WEIGHTS = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
               "mlp.linear_fc2.weight")


def _model(fp8, seed):
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    cfg = make_config(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, bf16=True, sequence_parallel=True,
                      fp8="hybrid" if fp8 else None, fp8_recipe="delayed", fp8_amax_history_len=4,
                      fp8_amax_compute_algo="max")
    model = GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ)
    if fp8:
        assert convert_to_fp8(model) == 2 * len(FP8_WEIGHTS)
        assert convert_to_fp8_weights(model) == 2 * len(FP8_WEIGHTS)
    mesh = parallel_state.get_data_parallel_mesh()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    if fp8:
        refresh_fp8_scales(model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, clip_grad=1.0), [model])
    return model, optimizer


def _step(model, optimizer, step):
    g = torch.Generator().manual_seed(1000 * step + parallel_state.get_data_parallel_rank())
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    loss = model(ids, torch.arange(SEQ).expand(MICRO, SEQ), None, labels=labels).float().mean()
    loss.backward()
    ok, _, _ = optimizer.step()
    optimizer.zero_grad()
    assert ok
    return loss.item()


def _masters(model):
    return {k: full_tensor(v).clone() for k, v in model.state_dict().items() if k.endswith("weight")}


def _histories(model):
    return {name: {role: h.amax_history.clone() for role, h in m.fp8_state.histories()}
            for name, m in model.named_modules() if getattr(m, "fp8_state", None) is not None}


def _check_gathered_weights(model, masters):
    """Each gathered fp8 weight is its full master cast with 448 / amax of the whole weight."""
    for i, layer in enumerate(model.decoder.layers):
        layer.unshard()
        for suffix in FP8_WEIGHTS:
            key = f"decoder.layers.{i}.{suffix}"
            module = layer.get_submodule(suffix.rsplit(".", 1)[0])
            local = _torch_compat.local_tensor(module.weight)
            assert isinstance(local, Fp8GatheredWeight), key
            full = masters[key]
            scale = torch.tensor(448.0 / float(full.abs().max()), dtype=torch.float64).float()
            tp_dim = 1 if "linear_proj" in suffix or "linear_fc2" in suffix else 0
            part = full.chunk(TP, dim=tp_dim)[parallel_state.get_tensor_model_parallel_rank()]
            expected = (part * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            assert torch.equal(local._data.view(torch.uint8), expected.view(torch.uint8)), key
        layer.reshard()


def _assert_same(actual: dict, expected: dict, what: str):
    assert actual.keys() == expected.keys(), what
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{what}: {key}"


def _case_checkpoints(root):
    setup_parallel(TP)
    fp8_dir, plain_dir = f"{root}/fp8", f"{root}/plain"

    # An fp8 run: three steps; MegatronOptimizer refreshes the scales after each.
    a, opt_a = _model(fp8=True, seed=1)
    for step in range(2):
        _step(a, opt_a, step)
        _check_gathered_weights(a, _masters(a))
    save_checkpoint(2, a, opt_a, save_dir=fp8_dir)  # the fp8 histories go with it
    saved_masters, saved_histories = _masters(a), _histories(a)
    assert all(float(h.max()) > 0 for roles in saved_histories.values() for h in roles.values())
    older_format_histories = fp8_state_dict(a)  # where checkpoints before module state kept them
    # The histories are the linears' module state, in the model's DCP state dict, not an
    # entry of their own (where format 2's common.pt held them).
    saved = torch_dcp.read_metadata(f"{fp8_dir}/iter_0000002")
    assert "fp8" not in saved and not os.path.exists(f"{fp8_dir}/iter_0000002/common.pt")
    assert {f"model.{name}._extra_state" for name in saved_histories} <= set(saved), sorted(saved)
    key = "model.decoder.layers.0.mlp.linear_fc1.weight"
    assert saved[key].properties.dtype == torch.float32, "fp8 weights are saved as fp32 masters"
    # Exported weights are the weights alone: the histories (extra state) are no tensor to export.
    export_safetensors(a, f"{root}/a.safetensors")
    if dist.get_rank() == 0:
        from safetensors.torch import load_file
        exported = load_file(f"{root}/a.safetensors")
        assert exported.keys() == {name for name, _ in a.named_parameters()}, sorted(exported)
        _assert_same({k: v for k, v in exported.items() if k in saved_masters}, saved_masters, "exported")
    uninterrupted_loss = _step(a, opt_a, 2)

    # Resumed in high precision: the same master weights, plain parameters.
    b, opt_b = _model(fp8=False, seed=2)
    load_checkpoint(b, opt_b, load_dir=fp8_dir)
    _assert_same(_masters(b), saved_masters, "fp8 checkpoint loaded without fp8")
    save_checkpoint(2, b, opt_b, save_dir=plain_dir)

    # Resumed in fp8: weights, optimizer state, histories and scales as saved; the
    # next step matches the uninterrupted run.
    c, opt_c = _model(fp8=True, seed=3)
    load_checkpoint(c, opt_c, load_dir=fp8_dir)  # restores the histories and recomputes the scales
    _assert_same(_masters(c), saved_masters, "fp8 checkpoint loaded with fp8")
    for name, roles in saved_histories.items():
        _assert_same(_histories(c)[name], roles, f"histories of {name}")
    _check_gathered_weights(c, saved_masters)
    resumed_loss = _step(c, opt_c, 2)
    assert resumed_loss == uninterrupted_loss, (resumed_loss, uninterrupted_loss)

    # A high-precision checkpoint resumed in fp8: scales from the loaded weights, fresh histories.
    d, opt_d = _model(fp8=True, seed=4)
    load_checkpoint(d, opt_d, load_dir=plain_dir)
    _assert_same(_masters(d), saved_masters, "plain checkpoint loaded with fp8")
    assert all(not h.calibrated and (h.amax_history is None or not h.amax_history.any())
               for m in d.modules() if getattr(m, "fp8_state", None) is not None for _, h in m.fp8_state.histories())
    _check_gathered_weights(d, saved_masters)
    loss = torch.tensor(_step(d, opt_d, 2))
    dist.all_reduce(loss)
    assert torch.isfinite(loss)

    # A checkpoint of the older format: weights in DCP, the histories under common.pt's
    # "fp8" (made here from the plain checkpoint of the same state): resumes exactly too.
    older_dir = f"{root}/older"
    def write_the_older_format():
        shutil.copytree(plain_dir, older_dir)
        rewrite_as_format_2(f"{older_dir}/iter_0000002", fp8=older_format_histories)
    on_rank_zero(write_the_older_format)
    e, opt_e = _model(fp8=True, seed=5)
    load_checkpoint(e, opt_e, load_dir=older_dir, verify=False)  # common.pt is not in the manifest
    for name, roles in saved_histories.items():
        _assert_same(_histories(e)[name], roles, f"histories of {name} from an older checkpoint")
    _check_gathered_weights(e, saved_masters)
    assert _step(e, opt_e, 2) == uninterrupted_loss


@pytest.mark.slow  # a pool case of several saves
def test_fp8_checkpoints_resume_with_and_without_fp8(pools, tmp_path):
    pools(4).run(_case_checkpoints, str(tmp_path), timeout=300)
