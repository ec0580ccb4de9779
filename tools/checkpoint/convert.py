"""Convert checkpoints between Hugging Face model directories and megatron_fsdp's
(Megatron-LM's tools/checkpoint/convert.py, its flags).

    # Hugging Face -> ours, then fine-tune (any TP x DP: the checkpoint reshards on load)
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver megatron_fsdp \\
        --load-dir llama-dir --save-dir ckpt
    torchrun ... examples/pretrain_gpt.py --load ckpt --finetune --use-checkpoint-args ...

    # ours (saved at any TP x DP layout) -> Hugging Face
    python tools/checkpoint/convert.py --model-type GPT --loader megatron_fsdp --saver hf \\
        --load-dir ckpt --save-dir hf-dir --tokenizer-model tokenizer.json

Loaders and savers: `hf` (config.json and model.safetensors, or shards with
model.safetensors.index.json), `megatron_fsdp` (our checkpoint directory:
tracker, iter_*) and `mcore` (Megatron-Core's torch_dist checkpoint directory,
model weights and the stored args). One process, no GPU: tensors are read and written one at a
time (the HF saver holds one shard), keeping their dtype unless
--saver-dtype says otherwise. The model flags the checkpoint stands for are
printed; an error is one line, and nothing is left in --save-dir.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

DTYPES = ("fp32", "bf16", "fp16")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-type", required=True, choices=["GPT"], help="the model family (GPT only)")
    p.add_argument("--loader", required=True, choices=["hf", "megatron_fsdp", "mcore"], help="the source's format")
    p.add_argument("--saver", required=True, choices=["hf", "megatron_fsdp", "mcore"], help="the target's format")
    p.add_argument("--load-dir", required=True, help="the source directory")
    p.add_argument("--save-dir", required=True, help="the target directory (missing or empty for --saver hf)")
    p.add_argument("--saver-dtype", choices=DTYPES, default=None, help="the target's dtype (None: the source's)")
    p.add_argument("--load-iteration", type=int, default=None,
                   help="--loader megatron_fsdp or mcore: this iteration (None: the tracker's)")
    p.add_argument("--true-vocab-size", type=int, default=None,
                   help="--loader mcore: the vocabulary before padding (None: its args' vocab_size, else every row)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1,
                   help="--saver mcore: the TP size whose vocabulary padding the checkpoint gets")
    p.add_argument("--no-verify-checkpoint", action="store_true", help="--loader megatron_fsdp: skip checksums")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="--loader hf, --saver mcore: Megatron-LM's vocabulary padding (x the TP size)")
    p.add_argument("--tokenizer-model", default=None,
                   help="--saver hf: a tokenizer.json (or its folder) to copy into --save-dir")
    p.add_argument("--max-shard-size", type=int, default=5 * 2 ** 30,
                   help="--saver hf: bytes per safetensors shard (above it: shards and an index)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_fsdp.dist_checkpointing.core import CheckpointError, describe
    from megatron_fsdp.training import checkpoint_conversion as conversion

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.saver_dtype)
    try:
        if args.loader == "hf":
            model = conversion.load_hf(args.load_dir, args.make_vocab_size_divisible_by)
        elif args.loader == "mcore":
            model = conversion.load_mcore(args.load_dir, args.load_iteration, args.true_vocab_size)
        else:
            model = conversion.load_megatron_fsdp(args.load_dir, args.load_iteration,
                                                  verify=not args.no_verify_checkpoint)
        if args.saver == "hf":
            conversion.save_hf(model, args.save_dir, dtype=dtype, max_shard_bytes=args.max_shard_size,
                               tokenizer_model=args.tokenizer_model)
            where = args.save_dir
        elif args.saver == "mcore":
            where = conversion.save_mcore(model, args.save_dir, dtype=dtype,
                                          target_tensor_parallel_size=args.target_tensor_parallel_size,
                                          make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        else:
            where = conversion.save_megatron_fsdp(model, args.save_dir, dtype=dtype, source=args.loader)
    except (CheckpointError, NotImplementedError, ValueError, OSError) as exc:
        print(f"convert.py: error: {exc}", file=sys.stderr)
        return 1
    except CheckpointException as exc:  # DCP's own, a BaseException: a failure while writing
        print(f"convert.py: error: writing {args.save_dir} failed ({describe(exc)})", file=sys.stderr)
        return 1
    except KeyError as exc:  # a config.json or stored args without a field the model needs
        print(f"convert.py: error: the source's configuration lacks {exc}", file=sys.stderr)
        return 1
    print(f"converted {args.load_dir} ({args.loader}) -> {where} ({args.saver}): {len(model.spec)} tensors, "
          f"vocabulary {model.true_vocab_size}")
    print(f"model flags: {conversion.model_flags(model.args)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
