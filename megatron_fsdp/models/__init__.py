"""Models built from megatron_fsdp layers."""
