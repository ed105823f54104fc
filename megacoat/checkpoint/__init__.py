"""Checkpoints: sharded save/load at any TP/DP(/PP) layout, exact resume, crash safety.

See format.py for the on-disk layout and docs/architecture.md ("Checkpoints") for the design.
Hugging Face and Megatron-LM checkpoints convert to and from this format in `megacoat.convert`,
which builds on this package (never the reverse).
"""
from .checkpointer import Checkpointer, apply_checkpoint_args, find_checkpoint, load_model_weights
from .format import CheckpointError, resolve_checkpoint_dir
from .reader import CheckpointReader

__all__ = ["Checkpointer", "CheckpointError", "CheckpointReader", "apply_checkpoint_args", "find_checkpoint",
           "load_model_weights", "resolve_checkpoint_dir"]
