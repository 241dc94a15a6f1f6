"""The composition of strategies for a layout (parallelize) and the Engine that trains with it."""

from paratrain.hybrid.engine import Engine, LossFn, split_batch
from paratrain.hybrid.parts import EngineOptions
from paratrain.hybrid.step import NonFiniteError, PendingStep, StepStats
from paratrain.hybrid.parallelize import OptimizerFactory, parallelize

__all__ = ["Engine", "EngineOptions", "LossFn", "NonFiniteError", "OptimizerFactory", "PendingStep", "StepStats",
           "parallelize", "split_batch"]
