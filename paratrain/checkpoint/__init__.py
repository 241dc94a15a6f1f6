"""Layout-free checkpoints: tensors by whole-model name in safetensors, the rest in JSON, written atomically.
Sharded (format 2, sharded.py): every rank writes its own pieces and reads back only what its layout
keeps; whole (format 1, io.py): one rank writes the gathered model."""

from paratrain.checkpoint.io import (
    FORMAT,
    SHARDED_FORMAT,
    CheckpointError,
    load_checkpoint,
    newest_verified,
    resolve_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from paratrain.checkpoint.sharded import (CheckpointReader, checkpoint_to_resume, load_sharded, newest_shared, save_sharded,
                                         verify_shared)

__all__ = ["FORMAT", "SHARDED_FORMAT", "CheckpointError", "CheckpointReader", "checkpoint_to_resume", "load_checkpoint", "load_sharded",
           "newest_shared", "newest_verified", "resolve_checkpoint", "save_checkpoint", "save_sharded",
           "verify_checkpoint", "verify_shared"]
