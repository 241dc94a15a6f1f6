"""The Hugging Face door: a local checkpoint folder in, trained under any layout.

    pretrained = paratrain.hf.from_pretrained("./tiny-llama")          # config.json + safetensors
    engine = paratrain.parallelize(pretrained.model, ctx, optimizer=..., init=pretrained.init,
                                   recipe=pretrained.recipe)

paratrain/hf/load.py: the model built on the meta device, and a Source that reads each rank's pieces
straight from the safetensors files. transformers is imported inside its functions only.
"""

from paratrain.hf.load import HFCheckpoint, Pretrained, from_pretrained

__all__ = ["HFCheckpoint", "Pretrained", "from_pretrained"]
