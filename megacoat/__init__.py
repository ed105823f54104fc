"""megacoat: Megatron-style GPT pretraining (see README.md)."""
from .api import load_model

__all__ = ["load_model"]
