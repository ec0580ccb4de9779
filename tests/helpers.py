"""Shared pieces of the multi-process test cases (run inside pool workers), and `tiered`, the fast loop's
grid helper."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.transformer import TransformerConfig


# Summation order differs between TP sizes; fp32 agreement to ~1e-5 relative
# is what reordering alone gives, while a real bug is off by orders more.
FP32_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


# A pool case's model-parallel groups time out as the pool's own group does: a rank whose peer
# raised fails in half a minute instead of Megatron's 30 (the case then fails by name).
CASE_GROUP_TIMEOUT_MINUTES = 0.5


def setup_parallel(tp: int = 1, seed: int = 1234, **kwargs) -> None:
    kwargs.setdefault("distributed_timeout_minutes", CASE_GROUP_TIMEOUT_MINUTES)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, **kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def on_rank_zero(section, *args) -> None:
    """`section(*args)` on rank 0 alone, then every rank goes on together. If it raises there,
    every rank raises (the others would otherwise wait for rank 0 in their next collective until
    the group's timeout)."""
    error = None
    if dist.get_rank() == 0:
        try:
            section(*args)
        except Exception as exc:  # noqa: BLE001  (told to the others, then raised here)
            error = exc
    told = [f"{type(error).__name__}: {error}" if error is not None else None]
    dist.broadcast_object_list(told, src=0)
    if error is not None:
        raise error
    if told[0] is not None:
        raise RuntimeError(f"rank 0 failed in {getattr(section, '__name__', 'its section')}: {told[0]}")


def tiered(values, fast) -> list:
    """pytest.mark.parametrize's `values`, each one not in `fast` marked slow: a grid whose
    representatives run in the fast loop (-m "not e2e and not slow") and the rest in the default
    suite (docs/development.md, Tests)."""
    fast = list(fast)
    unknown = [v for v in fast if v not in values]
    assert not unknown, f"tiered: {unknown} are not among the values {values}"
    return [v if v in fast else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for v in values]


def make_config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def full_tensor(t: torch.Tensor, stride: int = 1) -> torch.Tensor:
    """The full value of a parameter (or its gradient) of partition_stride `stride`: with
    stride s > 1 (a gated fc1) each TP rank's block holds s row slices ([gate_r; up_r]),
    and the full tensor is every rank's first slice, then every rank's second ([gate; up])."""
    full = t.full_tensor() if isinstance(t, DTensor) else t
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if stride == 1 or tp == 1:
        return full
    blocks = [block.chunk(stride) for block in full.chunk(tp)]
    return torch.cat([blocks[r][k] for k in range(stride) for r in range(tp)])


def _stride(p: torch.Tensor) -> int:
    return getattr(p, "partition_stride", 1)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full_tensor(p.detach(), _stride(p)).clone() for name, p in model.named_parameters()}


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient; also checks that a replicated parameter
    received the same gradient on every tensor-parallel rank."""
    grads = {}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        g = full_tensor(p.grad, _stride(p))
        if not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements):
            local = g.to_local() if isinstance(g, DTensor) else g
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(gathered, local.contiguous(), group=tp_group)
            for other in gathered[1:]:
                torch.testing.assert_close(other, gathered[0], rtol=0, atol=0,
                                           msg=lambda m: f"{name}: gradient differs across TP ranks\n{m}")
            g = local
        grads[name] = g.clone()
    return grads


def assert_close_dicts(actual: dict, expected: dict, what: str, **tolerance) -> None:
    tolerance = tolerance or FP32_TOLERANCE
    assert actual.keys() == expected.keys(), f"{what}: names differ: {sorted(actual.keys() ^ expected.keys())}"
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **tolerance,
                                   msg=lambda m: f"{what} {name}:\n{m}")


def batch(vocab: int, b: int = 2, s: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    weights = torch.rand(b, s, generator=g)
    positions = torch.arange(s).expand(b, s)
    return ids, labels, positions, weights


def spoil_tensor_data(checkpoint: str) -> int:
    """Overwrite the bytes of every tensor a DCP checkpoint holds (its non-tensor entries
    stay readable): a load that read or checksummed a tensor before its checks would fail
    differently. Returns how many tensor items were spoiled."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    spoiled = 0
    for index, where in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
            with open(os.path.join(checkpoint, where.relative_path), "r+b") as f:
                f.seek(where.offset)
                f.write(b"\xa5" * where.length)
            spoiled += 1
    return spoiled


def rewrite_as_format_2(checkpoint: str, **common_extra) -> None:
    """Give a checkpoint the non-tensor files of format 2 (before version 3 made them DCP
    entries): common.pt (the train state's keys, the scheduler, the loss scaler, plus
    `common_extra`) and rng/rank_*.pt. The loader reads common.pt where there is one."""
    import os

    from megatron_fsdp.dist_checkpointing import entries, torch_dcp

    saved = torch_dcp.read_metadata(checkpoint)
    names = [n for n in saved if n in ("train_state", "opt_param_scheduler", "grad_scaler") or n.startswith("rng.")]
    found = {n: entries.unpack(blob, n) for n, blob in torch_dcp.read_entries(checkpoint, names).items()}
    common = {"opt_param_scheduler": found.pop("opt_param_scheduler", None),
              "grad_scaler": found.pop("grad_scaler", None), **found.pop("train_state"), **common_extra}
    common["version"] = 2
    torch.save(common, os.path.join(checkpoint, "common.pt"))
    os.makedirs(os.path.join(checkpoint, "rng"), exist_ok=True)
    for name, state in found.items():
        torch.save(state, os.path.join(checkpoint, "rng", f"{name[len('rng.'):]}.pt"))


def converted_logits(ckpt: str, tp: int, ids: torch.Tensor, true_vocab_size: int) -> torch.Tensor:
    """Our GPT built from the model flags a checkpoint stores (as --use-checkpoint-args reads
    them), loaded from it at TP=`tp` across the vocabulary padding: the full logits of `ids`
    over the true vocabulary. A pool case (it initializes model parallelism)."""
    import torch.nn.functional as F

    from megatron_fsdp.models.gpt import GPTModel
    from megatron_fsdp.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron_fsdp.training.checkpointing import load_checkpoint
    from megatron_fsdp.training.offline_checkpoint import stored_model_args

    a = stored_model_args(ckpt)
    setup_parallel(tp, seed=0)
    config = TransformerConfig(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], ffn_hidden_size=a["ffn_hidden_size"],
        num_attention_heads=a["num_attention_heads"], num_query_groups=a["num_query_groups"],
        gated_linear_unit=a["swiglu"], activation_func=F.silu if a["swiglu"] else F.gelu,
        normalization=a["normalization"], layernorm_epsilon=a["norm_epsilon"],
        add_bias_linear=not a["disable_bias_linear"], add_qkv_bias=a.get("add_qkv_bias", False),
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp)
    padded = -(-true_vocab_size // (128 * tp)) * 128 * tp  # Megatron's padding at this TP size
    model = GPTModel(config, vocab_size=padded, max_sequence_length=a["max_position_embeddings"],
                     position_embedding_type="rope", rotary_base=a["rotary_base"],
                     rope_scaling=a.get("use_rope_scaling", False), rope_scaling_factor=a.get("rope_scaling_factor", 8.0),
                     share_embeddings_and_output_weights=not a["untie_embeddings_and_output_weights"]).eval()
    assert not load_checkpoint(model, None, None, ckpt, load_optim=False, true_vocab_size=true_vocab_size)[
        "rng_restored"]
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), attention_mask=None)
        if tp > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
    return logits[..., :true_vocab_size]


def run_convert(*args: str):
    """tools/checkpoint/convert.py's main() with `args`, in this process (the command line's tests
    launch it as a user does): (exit code, stdout, stderr)."""
    import contextlib
    import importlib.util
    import io
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "checkpoint",
                        "convert.py")
    spec = importlib.util.spec_from_file_location("convert_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = module.main(list(map(str, args)))
    return code, out.getvalue(), err.getvalue()


def run_readme_command(section: str, timeout: int = 600):
    """The first ```bash block of README.md's `## {section}`, run as written from the checkout
    (this interpreter's environment first on PATH); returns the finished process."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        text = f.read().split(f"## {section}", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S)[1]
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    return subprocess.run(["bash", "-e", "-c", block], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
