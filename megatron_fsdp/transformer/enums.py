import enum


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3
