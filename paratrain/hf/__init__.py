"""The Hugging Face door: a local checkpoint folder in, trained under any layout.

    pretrained = paratrain.hf.from_pretrained("./tiny-llama")          # config.json + safetensors
    engine = paratrain.parallelize(pretrained.model, ctx, optimizer=..., init=pretrained.init,
                                   recipe=pretrained.recipe)

    ...                                                                # train, save_sharded
    paratrain.hf.export_pretrained(checkpoint, "./out", source="./tiny-llama")  # from_pretrained loads it

paratrain/hf/load.py: the model built on the meta device, and a Source that reads each rank's pieces
straight from the safetensors files; paratrain/hf/export.py: a checkpoint streamed back into safetensors
shards with the source's configuration and tokenizer. transformers is imported inside functions only.
"""

from paratrain.hf.export import export_pretrained
from paratrain.hf.files import HFCheckpoint
from paratrain.hf.load import Pretrained, from_pretrained

__all__ = ["HFCheckpoint", "Pretrained", "export_pretrained", "from_pretrained"]
