"""Data: token sources and the layout-free global-batch loaders (token windows, any map-style dataset)."""

from paratrain.data.loader import DatasetLoader, GlobalBatchLoader, GlobalOrder, LoaderState
from paratrain.data.sources import BYTE_VOCAB, TokenSource, builtin_text, load_source, write_token_file

__all__ = ["BYTE_VOCAB", "DatasetLoader", "GlobalBatchLoader", "GlobalOrder", "LoaderState", "TokenSource",
           "builtin_text", "load_source", "write_token_file"]
