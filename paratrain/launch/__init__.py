"""Launching: local processes through torch's elastic launcher; what each worker runs."""

from paratrain.launch.failures import JobFailed, RankFailure
from paratrain.launch.local import launch, launch_script, launched_by_torchrun
from paratrain.launch.worker import leave, train_on_this_rank

__all__ = ["JobFailed", "RankFailure", "launch", "launch_script", "launched_by_torchrun", "leave", "train_on_this_rank"]
