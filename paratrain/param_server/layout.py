"""Which server owns which slice of the parameters: flat buckets, each cut evenly over the servers.

The trainable parameters are grouped as ZeRO groups them (size-capped buckets of one optimizer param group,
in the order backward produces gradients: paratrain.comm.plan_buckets), each flattened and padded to a
multiple of the server count S. Server j owns elements [j n / S, (j + 1) n / S) of every bucket with their
optimizer state (paratrain.comm.flat.FlatGroup's shard j: the same cut ZeRO makes over a shard group).

    bucket b, padded to n = ceil(numel / S) x S:   | server 0 | server 1 | ... | server S-1 |

A trainer keeps every bucket whole: its parameters are views of the bucket's flat buffer (a pull lands in
place) and its gradients views of a second one (a push sends a slice as it lies). A server keeps only its
slices (FlatGroup with shard_index j, not persistent), their masters and their optimizer state.

Tables named sparse (embeddings whose rows a batch touches few of) stay out of the buckets: each is cut into
contiguous row ranges, server j owning rows [j V / S, (j + 1) V / S) (paratrain.param_server.sparse).
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.comm import plan_buckets
from paratrain.comm.flat import FlatGroup, FlatStorage


def served_groups(params: list[nn.Parameter], group_of: dict[int, int], *, servers: int, shard: int, whole: bool,
                  bucket_bytes: int, device: torch.device) -> list[FlatGroup]:
    """The flat buckets of `params` cut over `servers` servers (FlatGroup's shards), their master the slice
    `shard`: whole on a trainer (every bucket's flat buffer kept, the parameters its views; colocated, the
    master is this trainer's own slice), only the slice on a dedicated server (the full buffer freed)."""
    planned = plan_buckets(params, cap_bytes=bucket_bytes, key=lambda p: group_of[id(p)])
    storage = FlatStorage(persistent=whole, device=device)
    return [FlatGroup(i, ps, shards=servers, shard_index=shard, optimizer_group=group_of[id(ps[0])], storage=storage)
            for i, ps in enumerate(planned)]

