"""Megatron's rounded constants of the tanh GELU, shared by the eager fused path
(fused_activations) and the Triton kernels (triton_activations)."""

SQRT_2_OVER_PI = 0.79788456  # sqrt(2 / pi)
CUBIC = 0.044715
CUBIC_GRAD = 0.1070322243  # sqrt(2 / pi) * 3 * 0.044715
