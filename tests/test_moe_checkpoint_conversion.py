"""tools/checkpoint/convert.py for mixture-of-experts models, against `transformers`: tiny random
Mixtral, Qwen2-MoE and Qwen3-MoE saved by `transformers` convert to our checkpoints and back to
the same files' tensors bit for bit; the checkpoints' stored flags build a model
(--use-checkpoint-args) giving the HF logits at EP 1, EP 2 and TP 2 + sequence parallel x EP 2; a
model fine-tuned at EP 2 x DP 2 by pretrain_gpt.py exports to a directory `transformers` loads with
our logits; generate_gpt.py at EP 2 generates transformers' greedy tokens; Megatron-Core
conversion refuses experts in one line."""

import json
import os
import re

import pytest
import torch

from helpers import run_convert, tiered
from hf_moe_cases import CONFIGS, VOCAB, case_checkpoint_logits, hf_moe_model, token_ids

transformers = pytest.importorskip("transformers")


def _convert(*args, expect_ok=True):
    code, stdout, stderr = run_convert("--model-type", "GPT", *args)
    assert (code == 0) == expect_ok, stdout + stderr
    return stdout if expect_ok else stderr


def _hf_dir(tmp_path, name):
    model, _ = hf_moe_model(name)
    path = str(tmp_path / f"hf-{name}")
    model.save_pretrained(path)
    return model, path


def _to_ours(tmp_path, hf_dir, name="ckpt"):
    ckpt = str(tmp_path / name)
    out = _convert("--loader", "hf", "--saver", "megatron_fsdp", "--load-dir", hf_dir, "--save-dir", ckpt)
    return ckpt, out


FLAGS = {  # what convert.py prints of each model's MoE flags
    "mixtral": "--num-experts 4 --moe-router-score-function softmax --moe-router-topk 2 --moe-ffn-hidden-size 48 "
               "--moe-layer-freq 1 --moe-aux-loss-coeff 0.02",
    "qwen2_moe": "--moe-layer-freq [1,0,1] --moe-router-pre-softmax --moe-aux-loss-coeff 0.001 "
                 "--moe-shared-expert-intermediate-size 12 --moe-shared-expert-gate",
    "qwen3_moe": "--kv-channels 16",
    "qwen3_moe_norm": "--moe-router-topk 3 --moe-ffn-hidden-size 8 --moe-layer-freq [0,1,0] --moe-aux-loss-coeff",
}


@pytest.mark.parametrize("name", tiered(sorted(CONFIGS), fast=["qwen2_moe"]))
def test_hf_to_ours_and_back_is_the_same_files_bit_for_bit(tmp_path, name):
    from safetensors.torch import load_file

    from megatron_fsdp.dist_checkpointing.hf import sparse_layers

    hf_model, hf_dir = _hf_dir(tmp_path, name)
    ckpt, out = _to_ours(tmp_path, hf_dir)
    assert FLAGS[name] in out, out
    back = str(tmp_path / "back")
    _convert("--loader", "megatron_fsdp", "--saver", "hf", "--load-dir", ckpt, "--save-dir", back)
    original, converted = (load_file(os.path.join(d, "model.safetensors")) for d in (hf_dir, back))
    assert original.keys() == converted.keys(), sorted(original.keys() ^ converted.keys())
    assert all(torch.equal(original[k], converted[k]) and original[k].dtype == converted[k].dtype for k in original)
    with open(os.path.join(hf_dir, "config.json")) as f:
        before = json.load(f)
    reloaded = getattr(transformers, type(hf_model).__name__).from_pretrained(back).eval()
    after = reloaded.config.to_dict()
    assert sparse_layers(after) == sparse_layers(before)  # (Qwen's decoder_sparse_step is written as mlp_only_layers)
    head_dim = before["hidden_size"] // before["num_attention_heads"]  # transformers' default
    for key in ("num_experts_per_tok", "norm_topk_prob", "head_dim",
                "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size", "qkv_bias",
                "num_local_experts", "num_experts", "router_aux_loss_coef", "tie_word_embeddings"):
        default = head_dim if key == "head_dim" else None
        assert (after.get(key) or default) == (before.get(key) or default), (key, after.get(key), before.get(key))
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf_model(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("name", tiered(sorted(CONFIGS), fast=["qwen2_moe"]))
def test_converted_checkpoints_give_the_hf_logits_at_ep_1_and_2_and_tp_2(pools, tmp_path, name):
    hf_model, hf_dir = _hf_dir(tmp_path, name)
    ckpt, _ = _to_ours(tmp_path, hf_dir)
    ids = token_ids()
    with torch.no_grad():
        expected = hf_model(ids).logits
    for world, tp, ep in ((1, 1, 1), (2, 1, 2), (4, 2, 2)):
        for rank, logits in enumerate(pools(world).run(case_checkpoint_logits, ckpt, tp, ep, ids, VOCAB)):
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"TP {tp} x EP {ep}, rank {rank}: {m}")


@pytest.mark.slow  # a pretrain() job in the worker pool
@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_finetune_at_ep2_dp2_then_export_gives_our_logits_in_transformers(pools, tmp_path, name):
    """HF -> ours; pretrain_gpt.py --load --finetune --use-checkpoint-args at EP 2 over 4 ranks
    (expert data parallel 2, the all-to-all dispatcher) trains 2 steps and saves; exported,
    transformers gives the logits of our model loaded from that checkpoint. A tiny learning rate
    keeps the weights next to the original's, so the export gives its logits too (and Qwen3-MoE's
    query/key norms were trained, not dropped)."""
    from pretrain_in_pool import pretrain_gpt_job

    hf_model, hf_dir = _hf_dir(tmp_path, name)
    converted, _ = _to_ours(tmp_path, hf_dir, "converted")
    trained, exported = str(tmp_path / "trained"), str(tmp_path / "exported")
    argv = ["--load", converted, "--finetune", "--use-checkpoint-args", "--use-torch-fsdp2",
            "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-6", "--train-iters", "2",
            "--mock-data", "--vocab-size", str(VOCAB), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--eval-iters", "0", "--num-workers", "0", "--log-interval", "1", "--save", trained, "--save-interval", "2"]
    outcomes = pools(4).run(pretrain_gpt_job, argv, timeout=400)
    out = "".join(text for _, text in outcomes)
    assert all(code == 0 for code, _ in outcomes), out[-3000:]
    assert "iteration        2/       2" in out and "expert-parallel 2" in out, out[-3000:]
    assert "load_balancing_loss" in out, out[-3000:]  # router_aux_loss_coef became the run's coefficient
    _convert("--loader", "megatron_fsdp", "--saver", "hf", "--load-dir", trained, "--save-dir", exported)
    reloaded = getattr(transformers, type(hf_model).__name__).from_pretrained(exported).eval()
    assert any(not torch.equal(reloaded.state_dict()[k], v) for k, v in hf_model.state_dict().items())
    ids = token_ids()
    with torch.no_grad():
        got, original = reloaded(ids).logits, hf_model(ids).logits
    torch.testing.assert_close(got, pools(1).run(case_checkpoint_logits, trained, 1, 1, ids, VOCAB)[0],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, original, atol=1e-3, rtol=1e-3)


@pytest.mark.slow  # generate_gpt.py in the worker pool
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_greedy_generation_at_ep2_is_transformers(pools, tmp_path, name):
    """generate_gpt.py --load CONVERTED --use-checkpoint-args at EP 2 (two ranks, each expert on
    one) generates the tokens transformers' greedy generate() does."""
    from pretrain_in_pool import generate_gpt_job

    hf_model, hf_dir = _hf_dir(tmp_path, name)
    converted, _ = _to_ours(tmp_path, hf_dir)
    prompt = [5, 17, 42, 3, 99, 0]
    outcomes = pools(2).run(generate_gpt_job, [
        "--load", converted, "--use-checkpoint-args", "--use-torch-fsdp2", "--expert-model-parallel-size", "2",
        "--vocab-size", str(VOCAB), "--prompts", " ".join(map(str, prompt)), "--num-tokens-to-generate", "10",
        "--greedy"], timeout=300)
    out = "".join(text for _, text in outcomes)
    assert all(code == 0 for code, _ in outcomes), out[-3000:]
    ours = [int(t) for t in re.search(r"> generated: '([\d ]*)'", out)[1].split()]
    with torch.no_grad():
        # (An explicit mask: from pad_token_id alone, transformers would mask the prompt's last token, a 0.)
        theirs = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   do_sample=False, max_new_tokens=10, pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ours) == 10 and ours == theirs


def test_use_checkpoint_args_builds_the_moe_model_and_keeps_a_given_aux_loss_coefficient(tmp_path, capsys):
    """The stored MoE flags replace the command line's; the load-balancing coefficient (a run
    default, as --seq-length) only where the command line gives none, 0.0 included."""
    from megatron_fsdp.training.arguments import parse_args

    _, hf_dir = _hf_dir(tmp_path, "qwen2_moe")
    ckpt, _ = _to_ours(tmp_path, hf_dir)
    run = ["--load", ckpt, "--use-checkpoint-args", "--use-torch-fsdp2", "--micro-batch-size", "1", "--lr", "1",
           "--train-iters", "1", "--mock-data", "--vocab-size", str(VOCAB)]
    config = parse_args(run).configs.model
    assert (config.num_moe_experts, config.moe_layer_freq, config.moe_router_pre_softmax) == (4, [1, 0, 1], True)
    assert (config.moe_shared_expert_intermediate_size, config.moe_shared_expert_gate, config.add_qkv_bias) == (
        12, True, True)
    assert config.moe_aux_loss_coeff == 0.001
    assert "--moe-aux-loss-coeff 0.001 from the checkpoint (none on the command line" in capsys.readouterr().out
    for given in ("0.0", "0.05"):
        assert parse_args([*run, "--moe-aux-loss-coeff", given]).configs.model.moe_aux_loss_coeff == float(given)
        assert parse_args([*run, f"--moe-aux-loss-coeff={given}"]).moe_aux_loss_coeff == float(given)


def test_megatron_core_conversion_refuses_experts_in_one_line(tmp_path):
    _, hf_dir = _hf_dir(tmp_path, "mixtral")
    ckpt, _ = _to_ours(tmp_path, hf_dir)
    target = tmp_path / "mcore"
    err = _convert("--loader", "megatron_fsdp", "--saver", "mcore", "--load-dir", ckpt, "--save-dir", str(target),
                   expect_ok=False)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--saver mcore: mixture-of-experts models (--num-experts 4) are not converted" in err
    assert not target.exists()


def test_loading_a_megatron_core_moe_checkpoint_is_refused_in_one_line(tmp_path, monkeypatch):
    from megatron_fsdp.training import checkpoint_conversion

    class MoEArgs:  # a torch_dist checkpoint's reader, as far as its stored args go
        def __init__(self, path, iteration):
            self.path, self.args = path, dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_experts=8)

    monkeypatch.setattr(checkpoint_conversion, "McoreReader", MoEArgs)
    err = _convert("--loader", "mcore", "--saver", "megatron_fsdp", "--load-dir", str(tmp_path), "--save-dir",
                   str(tmp_path / "out"), expect_ok=False)
    assert len(err.strip().splitlines()) == 1 and "--loader mcore: mixture-of-experts models (--num-experts 8)" in err
    assert not (tmp_path / "out").exists()


def test_a_moe_model_we_cannot_represent_is_one_line_and_writes_nothing(tmp_path):
    _, hf_dir = _hf_dir(tmp_path, "mixtral")
    config_path = os.path.join(hf_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    for change, says in ((dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
                         (dict(num_local_experts=3), "block_sparse_moe.gate.weight: [4, 32], the config says [3, 32]")):
        with open(config_path, "w") as f:
            json.dump({**config, **change}, f)
        target = tmp_path / "out"
        err = _convert("--loader", "hf", "--saver", "megatron_fsdp", "--load-dir", hf_dir, "--save-dir", str(target),
                       expect_ok=False)
        assert len(err.strip().splitlines()) == 1 and says in err, err
        assert not target.exists()
