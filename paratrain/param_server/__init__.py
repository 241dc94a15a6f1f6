"""The parameter server: trainers push gradients to the servers that own their slices, and pull parameters.

    layout.py        which server owns which slice: flat buckets cut evenly over the servers
    protocol.py      the messages (headers and slices) over gloo point-to-point, the peers' ranks
    server.py        ShardServer: a server's slices, its optimizer, a clock's update, its messages
    loops.py         a dedicated server's loop: synchronous, or asynchronous (async_server.py: SSP)
    client.py        ServerClient: a trainer's side (pushes, pulls; colocated: its own slice's server too)
    sparse.py        sparse embedding rows: pushed, pulled and updated only where a batch touched them
    setup.py         connect (a trainer's client, from parallelize) and build_server (a dedicated server)
    replay.py        an asynchronous run replayed in one process from the servers' arrival logs
(paratrain.train.serve runs a dedicated server: checkpoints, resuming, the CLI's.)
"""

from paratrain.param_server.client import Reply, ServerClient
from paratrain.param_server.protocol import ServerLost
from paratrain.param_server.server import ShardServer
from paratrain.param_server.setup import build_server, connect

__all__ = ["Reply", "ServerClient", "ServerLost", "ShardServer", "build_server", "connect"]
