"""Train/validation/test data iterators (Megatron-LM's `build_train_valid_test_data_iterators`).

The script's dataset provider gets the number of samples each split needs
and returns three datasets (or None); each becomes a loader that starts at
the samples already consumed (so a resumed run continues where the
checkpointed one stopped, at any data-parallel size) and yields this
data-parallel rank's micro-batches.
"""

from __future__ import annotations


from ..datasets.vocab_check import check_token_ids_within_vocab
from .datasets import build_pretraining_data_loader
from .global_vars import get_tokenizer
from .utils import print_rank_0


def get_train_valid_test_num_samples(args) -> tuple[int, int, int]:
    train = args.train_samples if args.train_samples else args.train_iters * args.global_batch_size
    eval_points = (args.train_iters // args.eval_interval if args.eval_interval else 0) + 1
    valid = eval_points * args.eval_iters * args.global_batch_size
    test = args.eval_iters * args.global_batch_size
    return train, valid, test


def cyclic_iter(iterable):
    while True:
        count = 0
        for item in iterable:
            count += 1
            yield item
        if count == 0:
            raise RuntimeError("cyclic_iter: the data loader produced no data (empty dataset?)")


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider, args):
    """(train, valid, test) iterators, each None when its split is absent;
    sets args.do_train, args.do_valid and args.do_test."""
    num_samples = get_train_valid_test_num_samples(args)
    print_rank_0(" > datasets target sizes (minimum size):")
    print_rank_0(f"    train:      {num_samples[0]}")
    print_rank_0(f"    validation: {num_samples[1]}")
    print_rank_0(f"    test:       {num_samples[2]}")
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets_provider(num_samples)
    # Every rank reads the files itself, so a bad id fails every rank alike, before training.
    check_token_ids_within_vocab((train_ds, valid_ds, test_ds), get_tokenizer().vocab_size, args.data_cache_path)
    train_loader = None if args.skip_train or train_ds is None else build_pretraining_data_loader(
        train_ds, args.consumed_train_samples, args=args)
    valid_loader = None if valid_ds is None else build_pretraining_data_loader(valid_ds, args.consumed_valid_samples, args=args)
    test_loader = None if test_ds is None else build_pretraining_data_loader(test_ds, 0, args=args)
    args.do_train = train_loader is not None and args.train_iters > 0
    args.do_valid = valid_loader is not None and args.eval_iters > 0
    args.do_test = test_loader is not None and args.eval_iters > 0

    def make(loader):
        if loader is None:
            return None
        return iter(loader) if args.dataloader_type == "single" else iter(cyclic_iter(loader))

    return make(train_loader), make(valid_loader), make(test_loader)
