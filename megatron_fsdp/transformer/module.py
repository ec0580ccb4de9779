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
