"""How the processes of a job are laid out: the degree of each strategy."""

from __future__ import annotations

from dataclasses import dataclass, replace

from paratrain.config.errors import ConfigError
from paratrain.config.pp_layout import layout_chunks
from paratrain.config.rules import (PS_MODES, TP_MODES, check_diloco, check_expert_parallel, check_fault_tolerance,
                                    check_parameter_server, check_shard_group, check_tp_mode, check_usp, grid_dp,
                                    grid_side)

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zero-bubble", "zb-h1", "zb-v", "dualpipev")
"""The pipeline schedules paratrain.pipeline.schedules builds, by name (config is the ground floor:
the names live here, the programs there)."""

V_CHUNKS: dict[str, int] = {"zb-v": 2, "dualpipev": 2}
"""The V-shaped schedules and the chunks each places on a rank (their virtual_stages, implied)."""

# Strategies whose issues have not landed yet; a degree above 1 is refused with this note.
_NOT_YET: dict[str, str] = {}


CP_MODES: tuple[str, ...] = ("ring", "ulysses", "usp")
"""How context parallelism's attention reaches the other ranks' keys and values (ParallelConfig.cp_mode)."""

CP_BALANCES: tuple[str, ...] = ("positions", "documents")
"""What context parallelism's split of a sequence balances over the cp ranks (ParallelConfig.cp_balance)."""

PS_ON_CPU = ("the parameter server exchanges CPU tensors over gloo point-to-point: CUDA trainers are not built in "
             "this version (their buffers would have to be staged through host memory); use --device cpu, or data "
             "parallelism / ZeRO (--zero 1-3) on CUDA")
"""The refusal of the parameter server on a CUDA device (before launch, and when a trainer connects)."""


class ScheduleError(ValueError):
    """A schedule that cannot run for these (stages, micro-batches, chunks): refused before launch."""


def check_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> None:
    """Every rule a schedule has, with the numbers and the fix."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ScheduleError(f"stages ({stages}), micro-batches ({microbatches}) and virtual stages ({chunks}) "
                            "must be >= 1")
    if name == "interleaved":
        if chunks < 2:
            raise ScheduleError("the interleaved schedule needs --virtual-stages >= 2 (chunks per rank); "
                                "with 1 it is 1F1B: use --schedule 1f1b")
        if microbatches % stages:
            lower = microbatches - microbatches % stages
            raise ScheduleError(
                f"the interleaved schedule sends micro-batches round the ring in groups of pp ({stages}): "
                f"micro-batches ({microbatches}) must be a multiple of it; use {max(lower, stages)} or "
                f"{lower + stages} (global_batch / (micro_batch x dp))")
    elif name in V_CHUNKS:
        if chunks != V_CHUNKS[name]:
            raise ScheduleError(f"{name} places {V_CHUNKS[name]} chunks on each pipeline rank in a V, so virtual_stages "
                                f"is {V_CHUNKS[name]} (implied: leave --virtual-stages out); got {chunks}")
    elif chunks != 1:
        raise ScheduleError(f"--virtual-stages {chunks} needs the interleaved schedule (got {name!r})")
    if name == "dualpipev" and microbatches < 2 * stages:
        raise ScheduleError(
            f"DualPipeV warms up 2 (pp - 1) micro-batches down the V before its steady state, which needs at least "
            f"2 x pp ({2 * stages}) of them: micro-batches ({microbatches}) < {2 * stages}; raise global_batch / "
            f"(micro_batch x dp) to {2 * stages} or more, or use --schedule zb-v")
    if name == "zb-h1" and microbatches < stages:
        raise ScheduleError(
            f"ZB-H1 fills the pipeline's bubble with the weight-gradient passes of micro-batches still in flight, "
            f"which needs at least pp ({stages}) of them: micro-batches ({microbatches}) < pp; raise global_batch / "
            f"(micro_batch x dp) to {stages} or more, or use --schedule zero-bubble")



@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of parallelism. Their product (dp x tp x pp) is the world size."""

    dp: int | None = None
    """Data-parallel degree: replicas, each reading 1/dp of the global batch. None: what the
    world size leaves after tp and pp."""
    tp: int = 1
    """Tensor-parallel degree: each layer's weights split over tp ranks (Megatron-style)."""
    tp_mode: str = "1d"
    """How tp splits each layer: '1d' (Megatron: weights sliced along one dim, activations whole between a
    column and a row layer) or '2d' (Optimus / SUMMA: tp = q x q ranks, weights and activations each in q x q
    blocks; paratrain.tensor_parallel.grid) or '2.5d' (Tesseract: tp = tp_depth x q x q, tp_depth such grids,
    each on its own share of the batch rows, their weight gradients summed over depth) or '3d' (a q x q x q cube,
    tp = q^3: all-gathers over two axes, reduce-scatters over the third; paratrain.tensor_parallel.cube)."""
    tp_depth: int = 1
    """tp_mode 2.5d: the grids stacked (d); tp = d x q^2. 1 is the 2d layout exactly."""
    sequence_parallel: bool = False
    """With tp > 1: norms, dropout and residuals between the split layers run on 1/tp of the
    sequence, all-gather / reduce-scatter replacing the all-reduces (Korthikanti et al. 2022)."""
    pp: int = 1
    """Pipeline-parallel degree: the model's layers cut into pp stages on different ranks."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved (needs virtual_stages >= 2), zero-bubble (I and W apart within
    1F1B's per-stage memory), zb-h1 (Qi et al.'s ZB-H1: W deferred into the bubble; needs micro-batches >= pp) or
    zb-v (Qi et al.'s ZB-V: two chunks a rank in a V, I and W apart, 1F1B's first-stage memory on every rank) or
    dualpipev (DeepSeek's DualPipeV: the V, each forward beside a backward of the other chunk; needs micro-batches
    >= 2 pp)."""
    virtual_stages: int = 1
    """Chunks per pipeline rank (the interleaved schedule): the model is cut into pp x this. A V-shaped schedule
    (zb-v) implies its 2: resolved() sets it."""
    pp_split: tuple[int, ...] = ()
    """First layer index of chunks 1 .. pp x virtual_stages - 1; empty: balanced by cost (GPT layers:
    0 the embedding, 1 .. n_layer the blocks, n_layer + 1 the final norm and head)."""
    pp_layout: str = ""
    """The cut written layer by layer in Megatron's spelling, e.g. "Et*3|t*4|t*4|t*3L" (paratrain.config.pp_layout):
    another way to give pp_split (not both); the run's checks turn it into pp_split against the model."""
    microbatches: int = 0
    """Micro-batches per pipeline step (SMP's spelling): must equal global_batch / (micro_batch x dp);
    0: whatever that is. Without a micro_batch, it sets micro_batch = global_batch / (dp x this)."""
    ep: int = 1
    """Expert-parallel degree, a divisor of dp: each group of ep consecutive dp ranks divides a MoE
    layer's experts among them and exchanges tokens by all-to-all; the dp / ep ranks holding the same
    experts reduce their gradients (ep folds into dp, as in DeepSpeed and Megatron)."""
    expert_tp: bool = False
    """Expert tensor parallelism: each expert's two matrices cut over tp along the expert width (column, then
    row parallel, as the dense MLP), so a tp rank holds and runs 1/tp of every expert of its ep share; false:
    experts replicated over tp. Needs tp > 1 and a MoE model. paratrain.expert_parallel.tensor."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks (2 x cp chunks, rank r holding chunks r
    and 2cp - 1 - r, so causal attention costs each rank the same); attention exchanges keys and values
    over them (cp_mode). Parameters are whole on every cp rank: gradients are reduced, and ZeRO shards,
    over dp x cp. paratrain.context_parallel."""
    cp_mode: str = "ring"
    """How attention sees the other ranks' keys and values: 'ring' (blocks passed round the cp ranks,
    merged by log-sum-exp), 'ulysses' (all-to-all from sequence shards to head shards and back) or 'usp'
    (both: Ulysses over cp_ulysses consecutive cp ranks, a ring across the cp / cp_ulysses such groups;
    paratrain.context_parallel.usp)."""
    cp_ulysses: int = 1
    """cp_mode 'usp': the cp ranks of one Ulysses group (1 < cp_ulysses < cp, dividing cp); the ring has
    cp / cp_ulysses ranks. 1 for the other modes."""
    cp_balance: str = "positions"
    """What the split of each sequence balances: 'positions' (the load-balanced causal split above, the same for
    every micro-batch) or 'documents' (micro-batches of packed documents cut into pieces dealt out by attention
    work, the sum of each token's position in its document + 1: paratrain.context_parallel.layout.document_split).
    Either gives one process's loss; 'documents' refuses dropout, MoE capacity and MTP (they key on positions)."""
    zero: int = 0
    """ZeRO stage over dp: 0 plain data parallelism; 1 shards optimizer state; 2 also gradients;
    3 also parameters (gathered around each wrapped module when it runs)."""
    shard_group: int | None = None
    """Hierarchical sharding (MiCS / HSDP): shard inside groups of this many dp ranks, replicate
    across the dp / shard_group groups. None: shard over all of dp. Under context parallelism a
    shard group is these dp ranks times their cp ranks."""
    reshard_after_forward: bool = True
    """ZeRO-3: free a unit's full parameters after its forward and gather them again for backward;
    false keeps them from forward to backward (more memory, one all-gather fewer per unit)."""
    offload: str = "none"
    """'optimizer': optimizer state and fp32 master weights in CPU memory, the update on the CPU
    (needs zero >= 1; on a CPU-only machine it changes nothing but must stay correct).
    'activations': each transformer block's saved activations go to pinned CPU memory in forward and
    come back, prefetched a block ahead, in backward. 'optimizer,activations': both."""
    grad_reduce: str = "auto"
    """How sharded gradients are reduced: 'reduce_scatter', 'all_reduce' (then each rank keeps its
    slice), or 'auto': reduce-scatter on NCCL, all-reduce on gloo (gloo's reduce-scatter is slower
    than its all-reduce of the same tensor: 45 ms vs 26 ms at 16 MiB on 2 CPU processes)."""
    bucket_mb: float = 25.0
    """Size of a gradient all-reduce bucket, in MiB (as torch DDP's bucket_cap_mb)."""
    keep_grads: bool = False
    """Keep the gradient buffers (buckets, ZeRO's flat buffers and shards) between steps, zeroed, instead of
    releasing them after each update (torch's zero_grad(set_to_none=True)): no allocation per step, and the
    gradients' bytes held while a step is not running."""
    ps_mode: str = "off"
    """The parameter server (paratrain.param_server): 'off'; 'sync': trainers push gradient buckets to the
    servers owning them, which sum them in trainer order, update and send the parameters back (data
    parallelism's result exactly); 'async': each server applies pushes as they arrive, a trainer running
    at most `staleness` clocks ahead of the slowest (needs dedicated servers)."""
    ps_servers: int = 0
    """Dedicated server processes beside the trainers (the last ps_servers ranks of the world); 0: each
    trainer serves a slice itself (colocated: ZeRO-2's traffic)."""
    staleness: int = 0
    """ps_mode 'async': how many clocks a trainer may run ahead of the slowest push (0: synchronous)."""
    ps_sparse: tuple[str, ...] = ()
    """Embedding tables (their weights' names, e.g. 'tok_emb.weight') whose rows travel only where a step
    touched them, and which the servers update only there (paratrain.param_server.sparse)."""
    fault_tolerance: str = "off"
    """'replica': dp cut into `replica_groups` groups of consecutive ranks, each its own job (launcher and world),
    meeting each step through a lighthouse store; a group that dies is dropped at the step it failed in and the
    others redo that step with the global batch divided anew (paratrain.topology.quorum), a group started again
    joins at a step boundary with the state from a peer (paratrain.train.fault_tolerance). 'off': one world."""
    dp_mode: str = "sync"
    """How the data-parallel ranks stay together: 'sync' (every step's gradients summed over all of dp) or
    'diloco' (Douillard et al. 2023: dp cut into `replica_groups` groups of consecutive ranks, each taking
    `inner_steps` optimizer steps on its own rows of the global batches with its gradients summed inside the
    group, then one outer Nesterov step on the groups' averaged pseudo-gradient; paratrain.data_parallel.diloco)."""
    replica_groups: int = 1
    """dp_mode 'diloco' or fault_tolerance 'replica': the groups dp is cut into (dp / replica_groups consecutive dp
    ranks each, ZeRO sharding inside a group); 1 otherwise."""
    inner_steps: int = 1
    """dp_mode 'diloco': the optimizer steps each group takes between two outer steps (DiLoCo's H)."""
    outer_lr: float = 0.7
    """dp_mode 'diloco': the outer step's learning rate (the paper's 0.7)."""
    outer_momentum: float = 0.9
    """dp_mode 'diloco': the outer step's Nesterov momentum (the paper's 0.9; 0 is plain averaging at outer_lr 1)."""
    outer_fragments: int = 1
    """dp_mode 'diloco': Streaming DiLoCo's fragments (consecutive parameters of about equal size, each meeting every
    inner_steps steps, staggered by inner_steps / outer_fragments: the same bytes in smaller bursts); divides
    inner_steps. 1: the whole model at once."""

    @property
    def trainers(self) -> int:
        """The ranks that train (every rank but the dedicated parameter servers); needs dp resolved."""
        if self.dp is None:
            raise ConfigError("dp is not resolved yet: call ParallelConfig.resolved(world_size)")
        return self.dp * self.tp * self.pp * self.cp

    @property
    def tp_split(self) -> int:
        """What tp splits the heads, widths and vocabulary by: tp under 1d, the grid side q under 2d, 2.5d and 3d."""
        return self.tp if self.tp_mode == "1d" else grid_side(self.tp_mode, self.tp, self.tp_depth)

    @property
    def tp_row_parts(self) -> int:
        """The parts tp splits each micro-batch's rows into: 1 under 1d, q under 2d, tp_depth x q under 2.5d, q^2
        under 3d."""
        if self.tp_mode == "3d":
            return self.tp_split ** 2
        return 1 if self.tp_mode == "1d" else self.tp_depth * self.tp_split

    @property
    def offloaded(self) -> frozenset[str]:
        """What `offload` moves to CPU memory: a subset of {'optimizer', 'activations'}."""
        return frozenset() if self.offload == "none" else frozenset(p.strip() for p in self.offload.split(",") if p.strip())

    def resolved(self, world_size: int) -> ParallelConfig:
        """This config with dp filled in and every rule checked against the world size."""
        for name in ("tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
            if value > 1 and name in _NOT_YET:
                raise ConfigError(
                    f"{name}={value}: {_NOT_YET[name]} is not yet supported; use {name}=1 "
                    "(data and tensor parallelism are what this version runs)"
                )
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.virtual_stages < 1:
            raise ConfigError(f"virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.pp_layout:
            self._check_pp_layout()
        if self.pp == 1 and (self.virtual_stages > 1 or self.pp_split):
            raise ConfigError("virtual_stages and pp_split cut the model into pipeline stages, and pp is 1: "
                              "set pp > 1 or drop them")
        if self.pp > 1 and self.zero == 3:
            raise ConfigError("zero 3 gathers parameters around each module's forward and backward, which a "
                              "pipeline schedule interleaves across micro-batches: use zero 1 or 2 with pp > 1")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError(
                "sequence_parallel splits the sequence over the tp ranks, and tp is 1: set tp > 1 "
                "or drop sequence_parallel"
            )
        if self.expert_tp and self.tp == 1:
            raise ConfigError("expert_tp cuts every expert over the tp ranks, and tp is 1: set tp > 1 or drop expert_tp")
        check_tp_mode(self)
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero must be one of 0, 1, 2, 3, got {self.zero}")
        if self.grad_reduce not in ("auto", "reduce_scatter", "all_reduce"):
            raise ConfigError(f"grad_reduce must be 'auto', 'reduce_scatter' or 'all_reduce', got {self.grad_reduce!r}")
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        self._check_context_parallel()
        check_parameter_server(self, world_size)
        dp = grid_dp(self, world_size - self.ps_servers)  # dedicated servers train nothing: the grid is the trainers'
        unknown = self.offloaded - {"optimizer", "activations"}
        if self.offload != "none" and (unknown or not self.offloaded):
            raise ConfigError(f"offload must be 'none', 'optimizer', 'activations' or 'optimizer,activations', "
                              f"got {self.offload!r}")
        if "optimizer" in self.offloaded and self.zero == 0:
            raise ConfigError(
                "offload=optimizer needs a ZeRO stage: with zero=0 the optimizer state is not held by "
                "the sharding engine that offloads it; set zero to 1, 2 or 3"
            )
        check_shard_group(self.shard_group, self.zero, dp)
        check_expert_parallel(self.ep, dp)
        check_diloco(self, dp)
        check_fault_tolerance(self, dp)
        implied = V_CHUNKS.get(self.schedule, 1) if self.pp > 1 and self.virtual_stages == 1 else self.virtual_stages
        return replace(self, dp=dp, virtual_stages=implied)  # a V schedule's two chunks a rank, unless given

    def _check_pp_layout(self) -> None:
        """pp_layout names the chunks itself: pp x virtual_stages of them (a V schedule's 2 implied), and no
        pp_split beside it."""
        if self.pp_split:
            raise ConfigError(f"pp_split {list(self.pp_split)} and pp_layout {self.pp_layout!r} both cut the pipeline: "
                              "give one")
        chunks = self.pp * (V_CHUNKS.get(self.schedule, 1) if self.virtual_stages == 1 else self.virtual_stages)
        written = layout_chunks(self.pp_layout)
        if written != chunks:
            raise ConfigError(f"pp_layout {self.pp_layout!r} writes {written} chunks ({written - 1} borders '|') and "
                              f"the pipeline has pp x virtual_stages = {chunks}: write {chunks} chunks, or change pp")

    def _check_context_parallel(self) -> None:
        if self.cp_mode not in CP_MODES:
            raise ConfigError(f"cp_mode must be one of {', '.join(CP_MODES)}, got {self.cp_mode!r}")
        check_usp(self.cp, self.cp_mode, self.cp_ulysses)
        if self.cp_balance not in CP_BALANCES:
            raise ConfigError(f"cp_balance must be one of {', '.join(CP_BALANCES)}, got {self.cp_balance!r}")

    @property
    def world_size(self) -> int:
        """Every process of the job: the trainers and the dedicated parameter servers."""
        return self.trainers + self.ps_servers
