from .clip_grads import clip_grad_by_total_norm_fp32, clip_grad_norm_, get_grad_norm_fp32

__all__ = ["clip_grad_by_total_norm_fp32", "clip_grad_norm_", "get_grad_norm_fp32"]
