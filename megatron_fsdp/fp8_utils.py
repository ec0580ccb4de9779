"""fp8 configuration rules that need none of the fp8 stack.

The configs (training/configs.py, DistributedDataParallelConfig) check fp8
weight all-gather against the rest of the configuration when they are built,
on every rank and before any communication. These checks read plain config
fields only, so they live outside `megatron_fsdp.fp8`: importing that package
loads the fp8 linears, the tensor subclass and the kernels (and through them
torch's compiler), which a run without fp8 never needs. `megatron_fsdp.fp8`
re-exports them (Megatron-Core keeps its fp8 helpers in `fp8_utils` too).
"""

from __future__ import annotations


def check_fp8_param_gather(config, ddp_config, reshard_after_forward) -> None:
    """Raise for a combination fp8 weight all-gather cannot serve; a no-op
    without `ddp_config.fp8_param_gather` and `config.fp8_param`. Checks
    configuration only (no communication): every rank raises alike."""
    if not getattr(ddp_config, "fp8_param_gather", False):
        if getattr(config, "fp8_param", False):
            raise ValueError("fp8_param=True needs DistributedDataParallelConfig(fp8_param_gather=True) "
                             "(Megatron's --fp8-param-gather sets both)")
        return
    if getattr(config, "fp8", None) is None:
        raise ValueError("fp8_param_gather=True needs fp8 training: set TransformerConfig.fp8 "
                         "(--fp8-format) to 'e4m3' or 'hybrid'")
    if getattr(config, "fp8_recipe", None) == "rowwise":
        raise NotImplementedError("fp8_param_gather=True with fp8_recipe='rowwise' is not supported: a gathered "
                                  "weight carries one scale, rowwise needs one per row; use "
                                  "fp8_recipe='tensorwise' or 'delayed', or leave fp8_param_gather off")
    check_fp8_reshard(reshard_after_forward)


def check_fp8_reshard(reshard_after_forward) -> None:
    """The one check of fp8 all-gather against FSDP's resharding (the DDP config runs it when
    built, the wrapper again for a config changed since)."""
    if not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"fp8_param_gather=True with reshard_after_forward={reshard_after_forward!r} is not supported: "
            "FSDP2's all-gather extensions cannot reshard to a smaller group; use True or False")
