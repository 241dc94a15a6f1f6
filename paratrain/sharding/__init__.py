"""Sharded data parallelism: ZeRO-1/2/3 and hierarchical (MiCS / HSDP) shard groups, one model of sharding."""

from paratrain.comm.flat import FlatGroup, FlatStorage
from paratrain.sharding.gather import ParamGatherer, Unit, WrapPolicy
from paratrain.sharding.options import ZeroOptions
from paratrain.sharding.zero import ZeroSync

__all__ = ["FlatGroup", "FlatStorage", "ParamGatherer", "Unit", "WrapPolicy", "ZeroOptions", "ZeroSync"]
