"""Pretrain a GPT model the Megatron way, with megatron_fsdp (Megatron-LM's pretrain_gpt.py).

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py \
        --use-torch-fsdp2 --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 \
        --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 \
        --micro-batch-size 4 --global-batch-size 16 --lr 3e-3 --train-iters 40 \
        --mock-data --vocab-size 128 --log-interval 5 --log-throughput

Flags are Megatron-LM's (see megatron_fsdp/training/arguments.py); real
data comes from --data-path (files written by tools/preprocess_data.py) with
--tokenizer-type and its files. The training loop is
megatron_fsdp.training.pretrain; this file only says what to build and how
to compute the loss.
"""

from __future__ import annotations

import json
from functools import partial

import torch

from megatron_fsdp import parallel_state
from megatron_fsdp.enums import ModelType
from megatron_fsdp.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_fsdp.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron_fsdp.training.arguments import core_transformer_config_from_args
from megatron_fsdp.utils import get_batch_on_this_cp_rank


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None) -> GPTModel:
    args = get_args()
    print_rank_0("building GPT model ...")
    config = core_transformer_config_from_args(args)
    return GPTModel(
        # As Megatron-LM's: the spec pins query/key norms and the experts (a spec without them
        # would build layers without --qk-layernorm's norms).
        config, transformer_layer_spec=get_gpt_layer_local_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, normalization=args.normalization),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor, vp_stage=vp_stage)


def get_batch(data_iterator):
    """tokens, labels, loss_mask, attention_mask, position_ids of the next micro-batch, on this rank's device."""
    batch = next(data_iterator)
    if not get_args().reset_attention_mask:
        # Without --reset-attention-mask the dataset's mask is the causal one, which the model's
        # causal attention applies without it: no [b, 1, s, s] copy to the device, no mask
        # arithmetic per layer, and SDPA's flash kernel (which takes no explicit mask) instead of
        # a masked kernel that computes every score. Megatron's Transformer Engine attention
        # likewise ignores the mask of a causal layer.
        batch.pop("attention_mask", None)
    # This context-parallel rank's chunks of the sequence (with --context-parallel-size > 1).
    batch = get_batch_on_this_cp_rank(batch)
    device = parallel_state.get_device()
    on_device = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return (on_device["tokens"], on_device["labels"], on_device["loss_mask"], on_device.get("attention_mask"),
            on_device["position_ids"])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Sum of the per-token losses under the mask, the number of tokens, and
    the [sum, tokens] report ("lm loss") the training loop averages."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model: GPTModel):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


def is_dataset_built_on_rank() -> bool:
    # Every rank reads its own micro-batches (the same ones across a tensor-parallel group).
    return True


def core_gpt_dataset_config_from_args(args):
    from megatron_fsdp.datasets.gpt_dataset import GPTDatasetConfig
    from megatron_fsdp.datasets.utils import get_blend_from_list

    if args.per_split_data_args_path:
        with open(args.per_split_data_args_path) as f:
            per_split = json.load(f)
        blend_per_split = [get_blend_from_list(per_split.get(split)) for split in ("train", "valid", "test")]
    else:
        blend_per_split = [get_blend_from_list(paths) for paths in
                           (args.train_data_path, args.valid_data_path, args.test_data_path)]
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=get_blend_from_list(args.data_path),
        blend_per_split=blend_per_split, split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    args = get_args()
    from megatron_fsdp.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron_fsdp.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    config = core_gpt_dataset_config_from_args(args)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, is_dataset_built_on_rank,
                                        config).build()


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step)
