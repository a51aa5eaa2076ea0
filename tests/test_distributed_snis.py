"""fused_ops.distributed.snis in multi-process runs on the CPU (gloo) at 4
ranks, uneven shards and a rank with no samples (tools/dist_checks.check_snis:
values and gradients against fused_ops.snis on the concatenated samples in
one process, bitwise agreement across ranks and calls).  The 2-rank layouts
run through tools/multi_gpu.py in test_distributed_modules.py.  Each run is
one spawn of the ranks, which check everything in turn (dist_helpers.py)."""

import datetime

import pytest
import torch
import torch.distributed as dist

import fused_ops.distributed as fd
from dist_helpers import requires_gloo, run_ranks
from tools import dist_checks


def _worker(rank, world, port, cases, seed):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for case in cases:
            dist_checks.check_snis(*case, seed=seed)
    finally:
        dist.destroy_process_group()


@requires_gloo
def test_distributed_snis_matches_single_process_at_4_ranks(seed):
    sizes = (3000, 0, 17, 9000)
    f64, f32 = torch.float64, torch.float32
    cases = [
        # (shard sizes, batch shape, D, moments, with samples, dtype)
        (sizes, (), 3, True, True, f64),
        (sizes, (2, 3), 2, False, True, f64),
        (sizes, (4,), 1, False, False, f64),
        (sizes, (2,), 4, True, True, f32),
    ]
    run_ranks(_worker, len(sizes), (cases, seed % 2**62), what="distributed snis")


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.snis(torch.randn(5))
