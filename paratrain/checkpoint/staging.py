"""The host memory an asynchronous save copies a rank's pieces into (paratrain.checkpoint.async_save), mapped by
the trainer and by its writer process."""

from __future__ import annotations

import os
import tempfile

import torch


class Staging:
    """The host buffer a rank's pieces are copied into: an anonymous memory file (Linux: nothing is left behind
    when both processes end) or, elsewhere, a file in the temporary folder."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd: int | None = None
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("paratrain-stage")
            os.ftruncate(self.fd, size)
            self.path = f"/proc/self/fd/{self.fd}"  # the same number in the writer (pass_fds)
        else:
            handle, self.path = tempfile.mkstemp(prefix="paratrain-stage-")
            os.close(handle)
        self.mapped = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)

    def close(self) -> None:
        del self.mapped
        if self.fd is not None:
            os.close(self.fd)
        elif os.path.exists(self.path):
            os.unlink(self.path)
