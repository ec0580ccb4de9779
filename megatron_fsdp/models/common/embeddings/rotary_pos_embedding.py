"""Rotary position embedding (RoPE), non-interleaved as in Megatron-Core's default."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .... import parallel_state
from ....utils import triton_kernels_for


def llama3_frequency_scaling(inv_freq: torch.Tensor, factor: float, low_freq_factor: float = 1.0,
                             high_freq_factor: float = 4.0, original_context: int = 8192) -> torch.Tensor:
    """Llama 3.1's RoPE scaling (Megatron-Core's `rope_scaling`, with its fixed low/high frequency
    factors and original context): wavelengths longer than original_context / low_freq_factor
    are stretched by `factor`, those shorter than original_context / high_freq_factor kept, and
    those between blended linearly in original_context / wavelength."""
    wavelength = 2 * math.pi / inv_freq
    long_wavelengths = original_context / low_freq_factor
    short_wavelengths = original_context / high_freq_factor
    blend = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelength > long_wavelengths, inv_freq / factor, inv_freq)
    middle = (wavelength >= short_wavelengths) & (wavelength <= long_wavelengths)
    return torch.where(middle, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Produces the rotation angles; `apply_rotary_pos_emb` rotates q and k with them."""

    def __init__(self, kv_channels: int, rotary_percent: float, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None, rotary_base: int = 10000,
                 rope_scaling: bool = False, rope_scaling_factor: float = 8.0,
                 use_cpu_initialization: bool = False, cp_group=None):
        super().__init__()
        if rotary_interleaved:
            raise NotImplementedError("rotary_interleaved=True is not supported")
        if cp_group is not None:
            raise NotImplementedError("context parallelism (cp_group) is not supported")
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}")
        dim = int(kv_channels * rotary_percent)
        if dim % 2 != 0 or dim == 0:
            raise ValueError(
                f"rotary dimension kv_channels * rotary_percent = {dim} must be a positive even number"
            )
        self.dim = dim
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.rotary_base = rotary_base
        self.rope_scaling_factor = rope_scaling_factor if rope_scaling else None
        device = None if torch.empty(0).device.type == "meta" else parallel_state.get_device()
        self.register_buffer("inv_freq", self._inverse_frequencies(device), persistent=False)

    def _inverse_frequencies(self, device) -> torch.Tensor:
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        inv_freq = 1.0 / (self.rotary_base ** exponents)
        if self.rope_scaling_factor is not None:
            inv_freq = llama3_frequency_scaling(inv_freq, self.rope_scaling_factor)
        return inv_freq

    def reset_buffers(self) -> None:
        """Recompute the frequencies (after materializing a meta-device model)."""
        with torch.no_grad():
            self.inv_freq.copy_(self._inverse_frequencies(self.inv_freq.device))

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> torch.Tensor:
        """Angles [max_seq_len, 1, 1, dim] (each frequency twice, as rotate-half expects)."""
        if packed_seq:
            raise NotImplementedError("packed sequences are not supported")
        positions = torch.arange(offset, offset + max_seq_len, device=self.inv_freq.device,
                                 dtype=torch.float32)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = torch.outer(positions, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def shield_rotary_angles(freqs: torch.Tensor) -> torch.Tensor:
    """fp32 angles as an int32 view of the same bits, which FSDP2's mixed-precision
    input cast leaves alone (it casts floating tensors only, inside containers too).

    At position 2048 an angle rounded to bf16 is off by up to 8 radians; Megatron
    rounds only cos/sin to the activation dtype. `apply_rotary_pos_emb` accepts
    either form, so a TransformerLayer that is an FSDP unit gets exact angles.
    """
    return freqs.view(torch.int32) if freqs.dtype == torch.float32 else freqs


def _unshield(freqs: torch.Tensor) -> torch.Tensor:
    return freqs.view(torch.float32) if freqs.dtype == torch.int32 else freqs


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _kernels_for(t: torch.Tensor):
    """triton_rope for a CUDA tensor where Triton is installed, else None (the eager path)."""
    return triton_kernels_for(t, "megatron_fsdp.models.common.embeddings.triton_rope")


class RotaryFunction(torch.autograd.Function):
    """The rotation by triton_rope's kernels, forward and backward (cos, sin: [s, rot])."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.fused = fused
        return _kernels_for(t).rope_fwd(t, cos, sin, fused)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _kernels_for(grad_output).rope_bwd(grad_output, cos, sin, ctx.fused), None, None, None


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config=None) -> torch.Tensor:
    """Rotate the first `freqs.size(-1)` channels of t [s, b, heads, head_dim].

    `freqs` are RotaryEmbedding's angles (fp32, or shielded by
    `shield_rotary_angles`). Megatron's two paths, chosen by
    `config.apply_rope_fusion`:
      False: cos/sin of the fp32 angles are rounded to t's dtype and the
        rotation runs in t's dtype (Megatron's unfused `_apply_rotary_pos_emb_bshd`).
      True: the rotation runs in fp32 with fp32 cos/sin and the result is
        rounded once to t's dtype, as Transformer Engine's fused RoPE kernel does.
    """
    freqs = _unshield(freqs)
    rot_dim = freqs.size(-1)
    freqs = freqs[: t.size(0)]
    fused = config is not None and config.apply_rope_fusion
    if freqs.dim() == 4 and freqs.shape[1:3] == (1, 1) and _kernels_for(t) is not None:
        # One kernel each way, the same numerics (triton_rope.py); angles per sample take the eager path.
        angles = freqs.reshape(t.size(0), rot_dim).float()
        cos, sin = angles.cos(), angles.sin()
        if not fused:
            cos, sin = cos.to(t.dtype), sin.to(t.dtype)
        return RotaryFunction.apply(t, cos, sin, fused)
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    if fused:
        x = t_rot.float()
        freqs = freqs.float()
        t_rot = (x * freqs.cos() + _rotate_half(x) * freqs.sin()).to(t.dtype)
    else:
        cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
        t_rot = t_rot * cos + _rotate_half(t_rot) * sin
    return torch.cat((t_rot, t_pass), dim=-1) if t_pass.numel() else t_rot
