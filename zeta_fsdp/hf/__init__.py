"""Hugging Face weights in and out of sharded models: ``load_pretrained``, ``save_pretrained``, ``consolidate_to_hf``."""

from .consolidate import consolidate_to_hf
from .load import load_pretrained
from .save import save_pretrained

__all__ = ["consolidate_to_hf", "load_pretrained", "save_pretrained"]
