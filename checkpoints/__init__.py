"""Checkpoint I/O: HF safetensors loading, orbax save/restore of converted params."""
from checkpoints.hf_loader import CheckpointError, load_params, safetensors_files
from checkpoints.orbax_io import is_orbax_checkpoint, restore_converted, save_converted

__all__ = ["CheckpointError", "load_params", "safetensors_files", "is_orbax_checkpoint",
           "restore_converted", "save_converted"]
from checkpoints.hf_writer import save_hf_checkpoint
