"""One rank-aware logger: rank 0 speaks at INFO, the others only at WARNING and above."""

from __future__ import annotations

import logging
import sys


def get_logger(rank: int) -> logging.Logger:
    logger = logging.getLogger("paratrain")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[paratrain rank {rank}] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return logger
