"""Layout-free checkpoints: full tensors by name in safetensors, the rest in JSON, written atomically."""

from paratrain.checkpoint.io import FORMAT, load_checkpoint, resolve_checkpoint, save_checkpoint

__all__ = ["FORMAT", "load_checkpoint", "resolve_checkpoint", "save_checkpoint"]
