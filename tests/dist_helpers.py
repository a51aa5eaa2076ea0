"""Multi-process runs for the distributed tests (test_distributed_snis.py,
test_distributed_modules.py): ranks spawned as fresh processes on a free
local port, one thread each, with a deadline on the join.  A rank that
raises or exits non-zero fails the run; one that hangs is killed at the
deadline (the process groups' own collective timeouts end a stuck collective
earlier).  Not a test file.

Importing it makes the repository's ``tools`` package importable (the
checks live in tools/dist_checks.py, the script in tools/multi_gpu.py): the
repository root goes last on ``sys.path``, so an installed fused_ops still
comes before the source tree's."""

import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

requires_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                   reason="needs torch.distributed gloo")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, target, args):
    torch.set_num_threads(1)
    target(rank, world, port, *args)


def run_ranks(target, world, args=(), deadline_s=120, what="run"):
    """``target(rank, world, port, *args)`` in ``world`` spawned processes
    (``target`` a module-level function; ``port`` free for the rendezvous)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(_rank_main, args=(world, free_port(), target, args), nprocs=world, join=False,
                             start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > end:
                pytest.fail(f"{what} with {world} ranks did not finish within {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
