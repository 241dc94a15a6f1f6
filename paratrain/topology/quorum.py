"""Replica groups with a quorum per step (`--fault-tolerance replica`): losing a group costs a step, not a relaunch.

The dp axis is cut into `replica_groups` groups, each its own job (its own launcher and torch.distributed world:
ZeRO, tp, pp, cp inside it as ever). The groups meet through the lighthouse (a TCPStore the top launcher holds) and,
each step, sum their gradients (after the group's own reduction) and their loss sums and token counts over the
groups in the quorum: one process group per place in a group (rank r of every member), built from the store under
the quorum's epoch, so no world-wide group exists that a lost group could break.

    start        the first groups meet; a group started later is a joiner (paratrain.train.fault_tolerance)
    reduce       each step: the all-reduce over the members, then the group agrees (MAX of a flag) whether every
                 rank's went through; if not, ReplicaLost on every rank of the group alike
    recover      after ReplicaLost: the surviving groups register under the epoch, wait RECOVERY_WINDOW_S for the
                 others, and the first to write the next epoch (compare_set) names the members; the step is redone
                 by them with the global batch divided anew (rows)
    boundary     before each step: the first member's leader admits the joiners that registered (the epoch after,
                 from the next step), and every rank switches to an epoch whose step has come

Store keys (under "ft/"): epoch/E {"members", "from_step", "join", "source", "joiners"}; start/G; alive/E/G; joins
(a counter); join/K the group of request K; admit/K the epoch that admits it; ready/E the source's leader reached it;
done once the run is over (a joiner still waiting gives up).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from paratrain.config.errors import ConfigError
from paratrain.config.parallel import ParallelConfig

MEET_TIMEOUT_S = 120.0
"""How long the groups wait for each other to start (launchers and imports take seconds; --timeout is a step's)."""

RECOVERY_WINDOW_S = 1.0
"""After a failure, how long a surviving group waits for the quorum's other groups to say they survived too."""

POLL_S = 0.01


class ReplicaLost(RuntimeError):
    """A collective over the replica groups failed on some rank of this group (a group died or stopped answering):
    raised on every rank of the group alike, before anything of the step was applied."""


class GroupLost(RuntimeError):
    """This replica group cannot go on (a rank of its own is gone, or the quorum went on without it)."""


@dataclass(frozen=True)
class Epoch:
    number: int
    members: tuple[int, ...]
    """The replica groups in the quorum, in order: a group's place here is where its rows of a global batch lie."""
    from_step: int
    """The first step (1-based) the epoch's members run together."""
    source: int | None = None
    """An epoch that admits joiners: the group that admitted them and sends them the state."""
    joiners: tuple[int, ...] = ()
    joins: int = 0
    """The join requests answered by this epoch or before (whoever coordinates next goes on from there)."""


def connect(address: str, timeout: timedelta) -> dist.TCPStore:
    """The lighthouse at HOST:PORT (a client: the top launcher holds the store)."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


def reach(address: str, parallel: ParallelConfig, *, group: int, rank: int, world: int, timeout_s: float,
          device: str) -> Quorum:
    """Replica group `group` of parallel.replica_groups' rank `rank` (of its own world of `world`), meeting the others
    at the lighthouse at HOST:PORT; a step's collectives wait up to timeout_s; under DiLoCo joiners are admitted at an
    outer round's first step (admit_every = inner_steps). CPU (gloo) only in this version."""
    if torch.cuda.is_available() and device != "cpu":
        raise ConfigError("fault_tolerance replica runs on the CPU (gloo) in this version: each group's launcher "
                          "would number its GPUs from 0, and a joiner's state travels over gloo's CPU point-to-point; "
                          "give device cpu")
    return Quorum(connect(address, timedelta(seconds=max(60.0, timeout_s))), group=group,
                  groups=parallel.replica_groups, rank=rank, world=world, timeout=timedelta(seconds=timeout_s),
                  admit_every=parallel.inner_steps if parallel.dp_mode == "diloco" else 1)


class Quorum:
    """This rank's view of the replica groups: the current epoch and the process group at its place in the groups."""

    def __init__(self, store: dist.Store, *, group: int, groups: int, rank: int, world: int, timeout: timedelta,
                 admit_every: int = 1) -> None:
        """group: this replica group's number; groups: how many the job has; rank, world: this rank's place in its
        group's own world and that world's size (ranks at the same place across groups are peers); admit_every:
        joiners start at a step after a multiple of it (DiLoCo: an outer round's first, where the groups' weights
        are the outer copy)."""
        self.store, self.group, self.groups, self.admit_every = store, group, groups, admit_every
        self.rank, self.world, self.timeout = rank, world, timeout
        self.epoch = Epoch(-1, (), 0)
        self.pg: dist.ProcessGroup | None = None
        self.joins_seen = 0
        self.last_error = ""
        """The first line of the newest failed collective over the groups."""

    # --- membership ---

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def coordinator(self) -> bool:
        """The first member's leader: it admits joiners and, in logs, speaks for the job."""
        return self.leader and bool(self.epoch.members) and self.epoch.members[0] == self.group

    def place(self) -> tuple[int, int]:
        """(this group's place among the members, how many there are)."""
        return self.epoch.members.index(self.group), len(self.epoch.members)

    def start(self) -> bool:
        """Meet the other groups: True when this group joins a job already running (its state comes from a peer:
        paratrain.train.fault_tolerance), False when it starts with the job (epoch 0: every group). Every rank waits
        on the store itself (not in a collective of its group, whose timeout is a step's)."""
        joining = False
        if self.leader:
            joining = self.store.check(["ft/epoch/0"])
            if not joining:
                self.store.set(f"ft/start/{self.group}", "1")
        joining = bool(_share([joining])[0])  # at once: the leader has only looked
        if joining:
            return True
        meet = max(MEET_TIMEOUT_S, self.timeout.total_seconds())
        self._wait([f"ft/start/{g}" for g in range(self.groups)], "every replica group to start", seconds=meet)
        if self.leader:
            self.store.compare_set("ft/epoch/0", "", json.dumps(
                {"members": list(range(self.groups)), "from_step": 1, "join": False, "joins": 0}))
        self._wait(["ft/epoch/0"], "the first epoch", seconds=meet)
        self._enter(self._read(0))
        return False

    def request_join(self) -> Epoch:
        """A joiner: ask to be admitted and wait (every rank on the store) for the epoch that admits this group."""
        request = [self.store.add("ft/joins", 1) if self.leader else 0]
        if self.leader:
            self.store.set(f"ft/join/{request[0]}", str(self.group))
        number = int(_share(request)[0])
        self._wait([f"ft/admit/{number}"], "the running groups to admit this one", forever=True)
        record = json.loads(self.store.get(f"ft/admit/{number}"))
        epoch = Epoch(record["epoch"], tuple(record["members"]), record["from_step"], record["source"],
                      tuple(record["joiners"]), record["joins"])
        self._wait([f"ft/ready/{epoch.number}"], "the running groups to reach the admitting step", forever=True)
        self._enter(epoch)
        return epoch

    def boundary(self, step: int) -> Epoch | None:
        """Before step `step` (1-based) on every rank: an epoch whose step has come is entered; then the coordinator
        admits the joiners registered since the last admission (the next epoch, from step + 1). Returns the entered
        epoch when it admits joiners (their state is to be sent: paratrain.train.fault_tolerance), else None."""
        entered = None
        following = self.epoch.number + 1
        if self.store.check([f"ft/epoch/{following}"]):
            epoch = self._read(following)
            if epoch.from_step == step:
                if epoch.source == self.group and self.leader:
                    self.store.set(f"ft/ready/{epoch.number}", "1")
                self._enter(epoch)
                entered = epoch if epoch.joiners else None
        if self.coordinator:
            self._admit(step)
        return entered

    def _admit(self, step: int) -> None:
        if step % self.admit_every:  # the joiners start at step + 1
            return
        requests = self.store.add("ft/joins", 0)
        if requests == self.joins_seen:
            return
        number = self.epoch.number + 1
        if self.store.check([f"ft/epoch/{number}"]):
            return  # an epoch is already on its way (a recovery's): admit at a later boundary
        joiners = {int(self.store.get(f"ft/join/{k}")): k for k in range(self.joins_seen + 1, requests + 1)}
        members = sorted(set(self.epoch.members) | set(joiners))
        record = {"members": members, "from_step": step + 1, "join": True, "source": self.group,
                  "joiners": sorted(set(joiners) - set(self.epoch.members)), "joins": requests}
        stored = json.loads(self.store.compare_set(f"ft/epoch/{number}", "", json.dumps(record)).decode())
        if stored != record:
            return  # a recovery took the epoch first: the joiners are admitted at a later boundary
        self.joins_seen = requests
        for k in joiners.values():
            self.store.set(f"ft/admit/{k}", json.dumps({"epoch": number, **record}))

    def end(self) -> None:
        """The run is over (the coordinator says so: a group waiting to join stops waiting)."""
        if self.coordinator:
            self.store.set("ft/done", "1")

    # --- each step ---

    def reduce(self, tensors: list[torch.Tensor], *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """Sum `tensors` over the members (in place; op: MIN for fp16's first loss scale), then agree inside the group
        that every rank's reduce went through: ReplicaLost on every rank of the group if not (nothing was applied
        yet: the step can be redone)."""
        failed, self.last_error = torch.zeros(1), ""
        if self.pg is not None:
            options = dist.AllreduceOptions()
            options.reduceOp = op
            try:
                works = [self.pg.allreduce([t], options) for t in tensors]
                for work in works:
                    work.wait()
            except RuntimeError as error:
                failed[0], self.last_error = 1.0, str(error).splitlines()[0]
        try:
            if self.world > 1:
                dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        except RuntimeError as error:
            raise GroupLost(f"replica group {self.group} lost one of its own ranks: {error}") from None
        if failed.item():
            raise ReplicaLost(f"a collective over the replica groups {list(self.epoch.members)} failed (epoch "
                              f"{self.epoch.number}){': ' + self.last_error if self.last_error else ' on a peer rank'}")

    def recover(self, step: int) -> Epoch:
        """After ReplicaLost in step `step`: the next epoch's members, the groups that said they survived at the same
        step within RECOVERY_WINDOW_S (or at once, all of them); this group redoes the step with them. A group left
        out (late, or at another step: a collective that went through on some groups only) stops with GroupLost and
        can join again. Every rank reads the epoch from the store."""
        number = self.epoch.number + 1
        if self.leader:
            self.store.set(f"ft/alive/{number}/{self.group}", str(step))
            others = [g for g in self.epoch.members if g != self.group]
            deadline = time.monotonic() + RECOVERY_WINDOW_S
            while time.monotonic() < deadline and not self.store.check([f"ft/alive/{number}/{g}" for g in others]):
                time.sleep(POLL_S)
            alive = [g for g in self.epoch.members if self.store.check([f"ft/alive/{number}/{g}"])
                     and int(self.store.get(f"ft/alive/{number}/{g}")) == step]
            proposal = {"members": alive, "from_step": step, "join": False, "joins": self.joins_seen}
            self.store.compare_set(f"ft/epoch/{number}", "", json.dumps(proposal))
        self._wait([f"ft/epoch/{number}"], f"the groups' epoch {number} after the failure")
        record = json.loads(self.store.get(f"ft/epoch/{number}"))
        if record["join"]:
            raise GroupLost(f"replica group {self.group}: a failure at step {step} met joiners being admitted "
                            f"(epoch {number}); this version does not recover both at once: restart the job")
        epoch = Epoch(number, tuple(record["members"]), record["from_step"], joins=record.get("joins", 0))
        if self.group not in epoch.members or epoch.from_step != step:
            raise GroupLost(f"replica group {self.group} (at step {step}) was left out of epoch {number} (members "
                            f"{list(epoch.members)} from step {epoch.from_step}): start it again to join")
        self._enter(epoch)
        return epoch

    # --- helpers ---

    def _enter(self, epoch: Epoch) -> None:
        self.epoch = epoch
        self.joins_seen = max(self.joins_seen, epoch.joins)  # requests this epoch's record has answered
        if len(epoch.members) == 1:
            self.pg = None
            return
        prefix = dist.PrefixStore(f"ft/pg/{epoch.number}/{self.rank}/", self.store)
        self.pg = dist.ProcessGroupGloo(prefix, epoch.members.index(self.group), len(epoch.members), self.timeout)

    def _read(self, number: int) -> Epoch:
        record = json.loads(self.store.get(f"ft/epoch/{number}"))
        return Epoch(number, tuple(record["members"]), record["from_step"], record.get("source"),
                     tuple(record.get("joiners", ())), record.get("joins", 0))

    def _wait(self, keys: list[str], what: str, *, forever: bool = False, seconds: float | None = None) -> None:
        seconds = self.timeout.total_seconds() if seconds is None else seconds
        deadline = None if forever else time.monotonic() + seconds
        while not self.store.check(keys):
            if deadline is not None and time.monotonic() > deadline:
                raise GroupLost(f"replica group {self.group} waited {seconds:.0f} s for {what}")
            if forever and self.store.check(["ft/done"]):
                raise GroupLost(f"replica group {self.group}: the run ended while it waited for {what}")
            time.sleep(POLL_S)

    # --- point to point at the same place of another group (paratrain.train.fault_tolerance) ---

    def send(self, tensor: torch.Tensor, group: int, tag: int) -> None:
        assert self.pg is not None
        self.pg.send([tensor], self.epoch.members.index(group), tag).wait()

    def recv(self, tensor: torch.Tensor, group: int, tag: int) -> None:
        assert self.pg is not None
        self.pg.recv([tensor], self.epoch.members.index(group), tag).wait()


def _share(values: list) -> list:
    """The group's rank 0's `values` on every rank of the group (its own world)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(values, src=0)
    return values
