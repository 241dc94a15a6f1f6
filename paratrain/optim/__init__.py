"""Optimizers whose step needs more than one element at a time, under every layout: Muon (paratrain.optim.muon) and
the interface any matrix optimizer plugs into (paratrain.optim.matrices, paratrain.optim.exchange)."""

from paratrain.optim.adamw import AdamW, adamw_step
from paratrain.optim.exchange import Held, MatrixExchange, newton_schulz_flops
from paratrain.optim.matrices import LocalMatrices, Matrices, MatrixOptimizer, NamedFactory, Segment
from paratrain.optim.muon import EXCLUDE, AdamWSettings, Muon, MuonFactory, MuonSettings, is_matrix, newton_schulz

__all__ = ["EXCLUDE", "AdamW", "AdamWSettings", "adamw_step", "Held", "LocalMatrices", "MatrixExchange", "MatrixOptimizer", "Matrices",
           "Muon", "MuonFactory", "MuonSettings", "NamedFactory", "Segment", "is_matrix", "newton_schulz",
           "newton_schulz_flops"]
