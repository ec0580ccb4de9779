"""Floating-point operations of one training iteration (Megatron-LM's
`num_floating_point_operations`, dense GPT), for the TFLOP/s in the log line.

For a global batch of B sequences of length s, L layers, hidden size h, FFN
hidden size f, q = kv_channels x heads, kv = kv_channels x query groups and
padded vocabulary V:

    F = 6 B s [ L (c h f + h (q + 2 kv) + q h) + h V ]  +  6 B s^2 L q

with c = 3 for SwiGLU (two input projections) and 2 otherwise. Each GEMM of
m x n by n x k costs 2mnk, and is run three times (forward, and the data
and weight gradients in backward); the first bracket is the linear layers
(MLP, QKV and output projections, logits); the second is QK^T and
softmax(QK^T)V, halved for the causal mask. Norms, softmax, activations
and the optimizer are not counted.
"""

from __future__ import annotations


def num_floating_point_operations(args, batch_size: int) -> float:
    """FLOPs of one iteration over `batch_size` sequences of `args.seq_length` tokens."""
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    kv_channels = args.kv_channels if args.kv_channels is not None else args.hidden_size // heads
    h, f, layers, s = args.hidden_size, args.ffn_hidden_size, args.num_layers, args.seq_length
    q = kv_channels * heads
    kv = kv_channels * groups
    c = 3 if args.swiglu else 2
    tokens = batch_size * s
    linear = 6 * tokens * (layers * (c * h * f + h * (q + 2 * kv) + q * h) + h * args.padded_vocab_size)
    core_attention = 6 * batch_size * s * s * layers * q
    return float(linear + core_attention)
