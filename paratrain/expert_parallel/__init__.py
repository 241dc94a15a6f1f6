"""Expert parallelism: the experts of MoE layers divided among ranks, tokens exchanged by all-to-all."""

from paratrain.expert_parallel.layout import AllToAllExperts, ExpertLayout, apply_expert_parallel

__all__ = ["AllToAllExperts", "ExpertLayout", "apply_expert_parallel"]
