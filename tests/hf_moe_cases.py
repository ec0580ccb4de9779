"""Tiny random Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) as
`transformers` saves them, and the pool cases that compare our GPT with them."""

from __future__ import annotations

import json
import os
import tempfile

import torch

# Each: the config class, the model class, and what the case adds to the common fields.
CONFIGS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            router_aux_loss_coef=0.02)),
    # A shared expert with its gate, q/k/v biases, and layer 1 dense (mlp_only_layers); tied embeddings.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=12,
        mlp_only_layers=[1], tie_word_embeddings=True, use_sliding_window=False)),
    # Query/key norms, a head size (16) other than hidden / heads (8), top-k weights as they are.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, head_dim=16, norm_topk_prob=False)),
    # Renormalized top-3 weights, and experts in every second layer (decoder_sparse_step 2: layer 1).
    "qwen3_moe_norm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=3, moe_intermediate_size=8, head_dim=16, norm_topk_prob=True,
        decoder_sparse_step=2)),
}
VOCAB = 100


def hf_moe_model(name: str):
    """(model, config.json as a dict) of a tiny random model of CONFIGS[name]. Every weight is
    random (norms around 1, biases too): a tensor in the wrong place changes the logits."""
    import transformers

    config_cls, model_cls, extra = CONFIGS[name]
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    config = getattr(transformers, config_cls)(**{**fields, **extra})
    config.architectures = [model_cls]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                torch.nn.init.normal_(p, std=0.5 if pname.endswith("bias") else 0.2)
    return model, config.to_dict()


def saved(model, path: str) -> tuple[dict, dict]:
    """`model` saved by transformers into `path`: (its tensors as the file holds them, config.json)."""
    from safetensors.torch import load_file

    model.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return load_file(os.path.join(path, "model.safetensors")), config


def token_ids(seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


def case_mapping_gives_the_hf_logits(name: str) -> tuple[float, float]:
    """One process: the model converted in memory (hf.py) gives transformers' logits, converts
    back to the saved tensors bit for bit, and (the control) the other routing rule would not give
    them. Returns (largest logit difference, that of the other routing rule)."""
    import dataclasses

    from helpers import setup_parallel
    from megatron_fsdp.dist_checkpointing.hf import gpt_arguments, hf_to_megatron_fsdp, megatron_fsdp_to_hf
    from megatron_fsdp.models.gpt import GPTModel
    from megatron_fsdp.transformer import TransformerConfig

    hf_model, _ = hf_moe_model(name)
    files, hf = saved(hf_model, tempfile.mkdtemp(prefix=f"hf-{name}-"))
    setup_parallel(1, seed=0)
    fields, kwargs = gpt_arguments(hf)
    state = hf_to_megatron_fsdp(files, hf)
    ids = token_ids()
    with torch.no_grad():
        expected = hf_model(ids).logits
    differences = []
    for config in (TransformerConfig(**fields),
                   dataclasses.replace(TransformerConfig(**fields), moe_router_pre_softmax=not
                                       fields["moe_router_pre_softmax"])):
        ours = GPTModel(config, **kwargs).eval()
        missing, unexpected = ours.load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
        with torch.no_grad():
            got = ours(ids, torch.arange(ids.shape[1]).expand(2, -1), attention_mask=None)
        differences.append(float((got - expected).abs().max()))
    back = megatron_fsdp_to_hf(state, hf)
    assert back.keys() == files.keys(), sorted(back.keys() ^ files.keys())
    assert all(torch.equal(back[k], files[k]) for k in files)
    return differences[0], differences[1]


def case_checkpoint_logits(ckpt: str, tp: int, ep: int, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Our GPT built from the flags a converted checkpoint stores (--use-checkpoint-args, through
    the pretraining flags' parser, as pretrain_gpt.py builds it) at TP `tp` (with sequence
    parallelism) x EP `ep`, loaded from the checkpoint: the full logits of `ids` over the true
    vocabulary, on every rank."""
    from helpers import setup_parallel
    from megatron_fsdp.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_fsdp.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron_fsdp.training.arguments import core_transformer_config_from_args, parse_args
    from megatron_fsdp.training.checkpointing import load_checkpoint

    args = parse_args(["--load", ckpt, "--use-checkpoint-args", "--use-torch-fsdp2", "--micro-batch-size", "1",
                       "--lr", "1", "--train-iters", "1", "--mock-data", "--vocab-size", str(vocab),
                       "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
                       *(["--sequence-parallel"] if tp > 1 else []), "--hidden-dropout", "0",
                       "--attention-dropout", "0"])
    setup_parallel(tp, seed=0, expert_model_parallel_size=ep)
    padded = -(-vocab // (128 * tp)) * 128 * tp  # Megatron's padding at this TP size
    model = GPTModel(core_transformer_config_from_args(args),
                     get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                              normalization=args.normalization),
                     vocab_size=padded, max_sequence_length=args.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=args.rotary_base,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights).eval()
    load_checkpoint(model, None, None, ckpt, load_optim=False, load_rng=False, true_vocab_size=vocab)
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), attention_mask=None)
        if tp > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
    return logits[..., :vocab]
