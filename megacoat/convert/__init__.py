"""Conversion between megacoat checkpoints and foreign formats (behind tools/checkpoint/convert.py).

Hugging Face Llama / GPT-2 directories (`hf.py`, `hf_llama.py`, `hf_gpt2.py`) and Megatron-LM's
`torch` and `torch_dist` checkpoints (`megatron*.py`) are read and written here; megacoat's own
format (sharded save/load, resharding, crash safety) lives in `megacoat.checkpoint`, which this
package builds on and which never imports it. `target.py` keeps conversions from overwriting or
rewinding a directory that already holds a checkpoint.
"""
from .hf import hf_to_megacoat, megacoat_to_hf
from .megatron import TokenizerFlags, megacoat_to_megatron, megatron_to_megacoat
from .reshard import megacoat_to_megacoat

__all__ = ["TokenizerFlags", "hf_to_megacoat", "megacoat_to_hf", "megacoat_to_megacoat", "megacoat_to_megatron",
           "megatron_to_megacoat"]
