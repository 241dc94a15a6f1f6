"""The parameter server: trainers push gradients to the servers that own their slices, and pull parameters.

    layout.py        which server owns which slice: flat buckets cut evenly over the servers
    protocol.py      the messages (headers and slices) over gloo point-to-point, the peers' ranks
    server.py        ShardServer: a server's slices, its optimizer, a clock's update, the synchronous loop
    async_server.py  the asynchronous loop with bounded staleness (SSP)
    client.py        ServerClient: a trainer's side (pushes, pulls; colocated: its own slice's server too)
    setup.py         connect (a trainer's client, from parallelize) and build_server (a dedicated server)
    serve.py         serve: a dedicated server's run, checkpoints included
    replay.py        an asynchronous run replayed in one process from the servers' arrival logs
"""

from paratrain.param_server.client import Reply, ServerClient
from paratrain.param_server.protocol import ServerLost
from paratrain.param_server.server import ShardServer
from paratrain.param_server.setup import build_server, connect

__all__ = ["Reply", "ServerClient", "ServerLost", "ShardServer", "build_server", "connect"]
