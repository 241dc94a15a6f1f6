"""Where each rank sits: ParallelDims (pure layout math), Mesh (one group per axis), init()."""

from paratrain.topology.context import Context, init
from paratrain.topology.dims import AXES, ParallelDims
from paratrain.topology.mesh import AxisGroup, Mesh

__all__ = ["AXES", "AxisGroup", "Context", "Mesh", "ParallelDims", "init"]

