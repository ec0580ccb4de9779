from .gpt_layer_specs import (ModuleSpec, get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                              get_gpt_layer_with_transformer_engine_spec)
from .gpt_model import GPTModel

__all__ = ["GPTModel", "ModuleSpec", "get_gpt_decoder_block_spec", "get_gpt_layer_local_spec",
           "get_gpt_layer_with_transformer_engine_spec"]
