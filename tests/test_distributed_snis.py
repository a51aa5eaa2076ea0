"""fused_ops.distributed.snis in multi-process runs on the CPU (gloo): 2 and
4 ranks, uneven shards and a rank with no samples; values and gradients
against fused_ops.snis on the concatenated samples in one process, bitwise
agreement across ranks and runs.  Each run is one spawn of the ranks, which
check everything in turn; a rank that fails or hangs fails the test
(init and collective timeouts, and a deadline on the join)."""

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fused_ops
import fused_ops.distributed as fd

OUT = ("log_norm_weights", "ess", "log_evidence", "mean", "variance")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _problem(sizes, batch, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    lw = (torch.randn(*batch, n, generator=g, dtype=torch.float64) * 3).to(dtype)
    x = (torch.randn(*batch, n, d, generator=g, dtype=torch.float64) + 1).to(dtype)
    ups = [torch.randn(*batch, n, generator=g, dtype=torch.float64).to(dtype)] + [
        torch.randn(tuple(s), generator=g, dtype=torch.float64).to(dtype) for s in (batch, batch, (*batch, d), (*batch, d))
    ]
    return lw, x, ups


def _loss(outs, ups, lnw_up):
    # The shard term uses this rank's slice; the replicated terms are the same on every rank.
    return (outs[0] * lnw_up).sum() + sum((o * u).sum() for o, u in zip(outs[1:], ups[1:]))


def _check_case(rank, world, sizes, batch, d, moments, with_samples, dtype):
    lw, x, ups = _problem(sizes, batch, d, dtype, seed=len(sizes) * 100 + d)
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    x_all = x if with_samples else None
    n_out = 5 if moments else (4 if with_samples else 3)

    # Single process, on the concatenation.
    lw1 = lw.clone().requires_grad_()
    x1 = x.clone().requires_grad_() if with_samples else None
    want = fused_ops.snis(lw1, x1, moments)
    leaves = [lw1] + ([x1] if with_samples else [])
    g_want = torch.autograd.grad(_loss(want[:n_out], ups, ups[0]), leaves)

    # This rank's shard.
    lws = lw[..., lo:hi].clone().requires_grad_()
    xs = x[..., lo:hi, :].clone().requires_grad_() if with_samples else None
    got = fd.snis(lws, xs, moments=moments)
    g_got = torch.autograd.grad(_loss(got[:n_out], ups, ups[0][..., lo:hi]), [lws] + ([xs] if with_samples else []))

    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got[0], want[0][..., lo:hi].detach(), **tol)
    for k in range(1, n_out):
        torch.testing.assert_close(got[k], want[k].detach(), **tol, msg=lambda m, k=k: f"{OUT[k]}: {m}")
    for k in range(n_out, 5):
        assert got[k].shape == (0,)
    torch.testing.assert_close(g_got[0], g_want[0][..., lo:hi], **tol)
    if with_samples:
        torch.testing.assert_close(g_got[1], g_want[1][..., lo:hi, :], **tol)

    # Deterministic: a second call gives the same bits; every rank holds the same replicated outputs.
    again = fd.snis(lws.detach(), None if xs is None else xs.detach(), moments=moments)
    for a, b in zip(got, again):
        assert torch.equal(a.detach(), b)
    for k in range(1, n_out):
        gathered = [torch.empty_like(got[k]) for _ in range(world)]
        dist.all_gather(gathered, got[k].detach().contiguous())
        assert all(torch.equal(t, gathered[0]) for t in gathered), OUT[k]


def _worker(rank, world, port, cases):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for case in cases:
            _check_case(rank, world, *case)
    finally:
        dist.destroy_process_group()


def _run(world, cases, deadline_s=120):
    ctx = mp.start_processes(_worker, args=(world, _free_port(), cases), nprocs=world, join=False,
                             start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > end:
                pytest.fail(f"distributed snis with {world} ranks did not finish within {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.parametrize("world,sizes", [(2, (700, 5000)), (4, (3000, 0, 17, 9000))],
                         ids=["2ranks-uneven", "4ranks-one-empty"])
def test_distributed_snis_matches_single_process(world, sizes):
    f64, f32 = torch.float64, torch.float32
    cases = [
        # (shard sizes, batch shape, D, moments, with samples, dtype)
        (sizes, (), 3, True, True, f64),
        (sizes, (2, 3), 2, False, True, f64),
        (sizes, (4,), 1, False, False, f64),
        (sizes, (2,), 4, True, True, f32),
    ]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _run(world, cases)


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.snis(torch.randn(5))
