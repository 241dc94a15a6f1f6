"""Where each rank sits: ParallelDims (every axis's degree, pure layout math), Mesh (one group per axis),
init() (join the job, then lay it out: join() and lay_out())."""

from paratrain.topology.context import Context, Member, init, join, lay_out
from paratrain.topology.dims import AXES, ParallelDims
from paratrain.topology.mesh import AxisGroup, Mesh

__all__ = ["AXES", "AxisGroup", "Context", "Member", "Mesh", "ParallelDims", "init", "join", "lay_out"]
