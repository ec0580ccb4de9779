"""Generate text from a checkpoint written by examples/pretrain_gpt.py.

    torchrun --nproc-per-node 2 examples/generate_gpt.py \
        <the model and tokenizer flags of the training run> \
        --tensor-model-parallel-size 2 --load CHECKPOINT_DIR \
        --prompts "def fibonacci(n):" "import os" --num-tokens-to-generate 40 --top_p 0.9

Any tensor-parallel size loads any checkpoint (the vocabulary padding
follows the new size); data-parallel ranks generate the same text. The
sampling flags are Megatron-LM's: --greedy (or --top_k 1) takes the most
likely token; --top_k K samples among the K most likely; --top_p P among
the most likely tokens whose cumulative probability first exceeds P; --temperature
divides the logits first. Sampling is seeded by --seed and identical on
every rank. Generation stops at the tokenizer's end-of-document token or
after --num-tokens-to-generate tokens (or at --max-position-embeddings).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pretrain_gpt import model_provider  # noqa: E402

from megatron_fsdp import parallel_state  # noqa: E402
from megatron_fsdp.training.arguments import parse_args  # noqa: E402
from megatron_fsdp.training.checkpointing import load_checkpoint  # noqa: E402
from megatron_fsdp.training.error_report import report_errors  # noqa: E402
from megatron_fsdp.training.global_vars import get_tokenizer  # noqa: E402
from megatron_fsdp.training.initialize import (check_launched_by_torchrun, distributed_job,  # noqa: E402
                                               initialize_distributed, initialize_megatron)
from megatron_fsdp.training.training import setup_tokenizer  # noqa: E402
from megatron_fsdp.training.utils import print_rank_0  # noqa: E402


def add_text_generate_args(parser):
    group = parser.add_argument_group("text generation")
    group.add_argument("--prompts", nargs="+", required=True)
    group.add_argument("--num-tokens-to-generate", type=int, default=30)
    group.add_argument("--greedy", action="store_true")
    group.add_argument("--top_k", type=int, default=0)
    group.add_argument("--top_p", type=float, default=0.0)
    group.add_argument("--temperature", type=float, default=1.0)
    return parser


# Generation trains nothing and reads no data: these training flags get values that satisfy the parser.
GENERATION_DEFAULTS = dict(micro_batch_size=1, lr=1.0, train_iters=1, mock_data=True, no_load_optim=True,
                           no_load_rng=True, exit_on_missing_checkpoint=True)


def check_sampling_args(top_k: int, top_p: float, temperature: float, greedy: bool) -> None:
    if top_k < 0 or not 0.0 <= top_p <= 1.0 or temperature <= 0.0:
        raise ValueError(f"need --top_k >= 0, --top_p in [0, 1] and --temperature > 0, got {top_k}, {top_p}, "
                         f"{temperature}")
    if top_k > 1 and top_p > 0.0:
        raise ValueError("--top_k and --top_p exclude each other (as in Megatron-LM)")
    if greedy and (top_k > 1 or top_p > 0.0):
        raise ValueError("--greedy excludes --top_k > 1 and --top_p")


def sampling_probabilities(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0,
                           temperature: float = 1.0) -> torch.Tensor:
    """The distribution a token is drawn from: softmax(logits / temperature)
    restricted to the top_k largest logits, or to the most likely tokens up
    to and including the first one whose cumulative probability exceeds
    top_p (Megatron-LM's nucleus rule), renormalized."""
    logits = logits.float() / temperature
    if top_k > 1:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    elif top_p > 0.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove = cumulative > top_p
        remove[1:] = remove[:-1].clone()
        remove[0] = False
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(0, order, remove), float("-inf"))
    return torch.softmax(logits, dim=-1)


def next_token(logits: torch.Tensor, top_k: int, top_p: float, temperature: float, greedy: bool,
               generator: Optional[torch.Generator]) -> int:
    if greedy or top_k == 1:
        return int(torch.argmax(logits))
    probabilities = sampling_probabilities(logits, top_k, top_p, temperature)
    return int(torch.multinomial(probabilities.cpu(), 1, generator=generator))


@torch.no_grad()
def generate(model, prompt_ids: list[int], num_tokens: int, *, vocab_size: int, eod: Optional[int],
             max_length: int, top_k: int = 0, top_p: float = 0.0, temperature: float = 1.0, greedy: bool = False,
             generator: Optional[torch.Generator] = None) -> list[int]:
    """The continuation of `prompt_ids` (the whole sequence recomputed per
    token). Every rank must call it; rank 0's choice is broadcast, so all
    ranks produce the same tokens."""
    device = parallel_state.get_device()
    tokens = list(prompt_ids)
    generated: list[int] = []
    while len(generated) < num_tokens and len(tokens) < max_length:
        ids = torch.tensor([tokens], device=device)
        positions = torch.arange(len(tokens), device=device).unsqueeze(0)
        logits = model(ids, positions, None, runtime_gather_output=True)[0, -1, :vocab_size]
        choice = torch.tensor([next_token(logits, top_k, top_p, temperature, greedy, generator)], device=device)
        dist.broadcast(choice, src=0)
        token = int(choice.item())
        if token == eod:
            break
        tokens.append(token)
        generated.append(token)
    return generated


def main() -> None:
    check_launched_by_torchrun()
    args = parse_args(extra_args_provider=add_text_generate_args, defaults=GENERATION_DEFAULTS)
    check_sampling_args(args.top_k, args.top_p, args.temperature, args.greedy)
    if not args.load:
        raise SystemExit("generate_gpt.py needs --load CHECKPOINT_DIR")
    # One sequence at a time, of any length: nothing to split across tensor-parallel ranks.
    args.sequence_parallel = False
    if args.context_parallel_size != 1:
        raise SystemExit(f"generate_gpt.py runs at --context-parallel-size 1 (got {args.context_parallel_size}): "
                         "a checkpoint saved at any context-parallel size loads there")
    with report_errors():  # an error from here on: one line for the job, exit code 1
        initialize_distributed(args)
        with distributed_job():
            initialize_megatron(args)
            vocab_size = setup_tokenizer(args)
            tokenizer = get_tokenizer()
            model = model_provider()
            loaded = load_checkpoint(model, None, None, args.load, load_optim=False, load_rng=False,
                                     true_vocab_size=vocab_size, verify=not args.no_verify_checkpoint,
                                     exit_on_missing_checkpoint=True)
            print_rank_0(f"> loaded checkpoint {loaded['path']} (iteration {loaded['iteration']})")
            model.eval()
            generator = torch.Generator().manual_seed(args.seed)
            for prompt in args.prompts:
                continuation = generate(model, tokenizer.tokenize(prompt), args.num_tokens_to_generate,
                                        vocab_size=vocab_size, eod=tokenizer.eod,
                                        max_length=args.max_position_embeddings, top_k=args.top_k, top_p=args.top_p,
                                        temperature=args.temperature, greedy=args.greedy, generator=generator)
                print_rank_0(f"> prompt: {prompt!r}\n> generated: {tokenizer.detokenize(continuation)!r}")


if __name__ == "__main__":
    main()
