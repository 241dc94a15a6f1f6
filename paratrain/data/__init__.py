"""Data: token sources and the layout-free global-batch loaders (token windows, any map-style dataset)."""

from paratrain.data.loader import DatasetLoader, GlobalBatchLoader, GlobalOrder, LoaderState
from paratrain.data.mixture import MixtureLoader, Source, WeightSchedule
from paratrain.data.sources import (BYTE_VOCAB, RunData, TokenSource, builtin_text, load_source, open_data,
                                    write_token_file)

__all__ = ["BYTE_VOCAB", "DatasetLoader", "GlobalBatchLoader", "GlobalOrder", "LoaderState", "MixtureLoader",
           "RunData", "Source", "TokenSource", "WeightSchedule", "builtin_text", "load_source", "open_data",
           "write_token_file"]
