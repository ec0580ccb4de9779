"""MegatronModule: the base class Megatron-Core's models derive from."""

from __future__ import annotations

import torch


class MegatronModule(torch.nn.Module):
    """A torch module that carries its TransformerConfig as `self.config`
    (what `megatron_fsdp.utils.get_model_config` and the schedules read)."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The state dict a checkpoint stores; subclasses override it to leave entries out."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def set_is_first_microbatch(self) -> None:
        """With fp8, tell every submodule that has an `is_first_microbatch`
        flag that a new step starts (fp8 layers refresh cached casts of their
        weights then). Without fp8 nothing needs it."""
        if getattr(self.config, "fp8", None) is None:
            return
        if not hasattr(self, "_modules_with_is_first_microbatch"):
            self._modules_with_is_first_microbatch = [m for m in self.modules()
                                                      if hasattr(m, "is_first_microbatch")]
        for module in self._modules_with_is_first_microbatch:
            module.is_first_microbatch = True
