"""Pieces of the pretraining entry point (examples/pretrain_gpt.py)."""
