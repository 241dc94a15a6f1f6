"""Data: token sources and the layout-free global-batch loader."""

from paratrain.data.loader import GlobalBatchLoader, LoaderState
from paratrain.data.sources import BYTE_VOCAB, TokenSource, builtin_text, load_source, write_token_file

__all__ = ["BYTE_VOCAB", "GlobalBatchLoader", "LoaderState", "TokenSource", "builtin_text", "load_source",
           "write_token_file"]
