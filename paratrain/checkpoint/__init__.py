"""Layout-free checkpoints: full tensors by name in safetensors, the rest in JSON, written atomically."""

from paratrain.checkpoint.io import (
    FORMAT,
    CheckpointError,
    load_checkpoint,
    newest_verified,
    resolve_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

__all__ = ["FORMAT", "CheckpointError", "load_checkpoint", "newest_verified", "resolve_checkpoint", "save_checkpoint",
           "verify_checkpoint"]
