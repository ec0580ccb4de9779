from .language_model_embedding import LanguageModelEmbedding
from .rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb

__all__ = ["LanguageModelEmbedding", "RotaryEmbedding", "apply_rotary_pos_emb"]
