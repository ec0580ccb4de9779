"""Megatron-LM's training package on megatron_fsdp: `pretrain`, flags, checkpoints, logging.

    from megatron_fsdp.training import get_args, pretrain, print_rank_0
"""

from .global_vars import get_args, get_tokenizer
from .utils import print_rank_0, print_rank_last


def __getattr__(name):
    # pretrain pulls in the whole stack (models, FSDP, optimizer): import it on first use,
    # so that light modules of this package (arguments, tokenizers) stay cheap to import.
    if name == "pretrain":
        from .training import pretrain
        return pretrain
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["get_args", "get_tokenizer", "pretrain", "print_rank_0", "print_rank_last"]
