import enum


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3


# Megatron's --cp-comm-type values: how context-parallel attention sees the whole sequence
# (transformer/cp_attention.py).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
