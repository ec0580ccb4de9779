"""_BaseDataParallel: the interface Megatron-Core's training loop calls."""

from __future__ import annotations

from contextlib import contextmanager

import torch


class _BaseDataParallel(torch.nn.Module):
    """A data-parallel wrapper around `module` (Megatron-Core's contract).

    Subclasses implement the gradient synchronization; this base forwards
    calls and state dicts to the wrapped module.
    """

    is_data_parallel_wrapper = True  # what megatron_fsdp.utils.unwrap_model looks through

    def __init__(self, config, module: torch.nn.Module):
        super().__init__()
        self.config = config
        self.module = module

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Context in which gradients accumulate locally, without communication."""
        yield

    def start_grad_sync(self, *unused) -> None:
        """Launch gradient synchronization (or a no-op where it starts in backward)."""

    def finish_grad_sync(self) -> None:
        """Block until gradient synchronization is complete."""

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient by `scaling_factor`."""
        with torch.no_grad():
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Drop every gradient before the next accumulation starts."""
        for p in self.module.parameters():
            p.grad = None

    def broadcast_params(self) -> None:
        """Make every data-parallel replica hold the same parameters."""

    def state_dict(self, prefix: str = "", keep_vars: bool = False, destination=None):
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars, destination=destination)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
