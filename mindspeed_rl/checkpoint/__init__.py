"""Checkpoints: megatron distributed checkpoints (layout-independent) and their directory layout."""

from mindspeed_rl.checkpoint.manifest import MANIFEST_FILE, verify_checkpoint
from mindspeed_rl.checkpoint.megatron_dir import (
    META_FILE, TRACKER_FILE, checkpoint_path, load_megatron_checkpoint, read_meta,
    save_megatron_checkpoint, write_meta,
)
from mindspeed_rl.errors import CheckpointError

__all__ = [
    "CheckpointError", "MANIFEST_FILE", "META_FILE", "TRACKER_FILE", "checkpoint_path",
    "load_megatron_checkpoint", "read_meta", "save_megatron_checkpoint", "verify_checkpoint",
    "write_meta",
]
