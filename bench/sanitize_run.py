"""A small CUDA run of every kernel path, for compute-sanitizer.

    compute-sanitizer --tool memcheck python bench/sanitize_run.py

Covers the vectorised and scalar fast paths (short and long rows), the general
path (D > 512, and parameters too large for shared memory) and float64, and
checks each result against the reference so a silent error also fails.
"""

import sys

import torch

import fused_ops
from fused_ops import reference

CASES = [
    # (N, D, K, dtype)          path exercised
    (1000, 16, 3, torch.float32),  # fast, float4 loads, 4 lanes per row
    (777, 3, 2, torch.float32),  # fast, scalar loads
    (300, 200, 5, torch.float32),  # fast, float4 loads, long rows (50 chunks over 32 lanes)
    (129, 101, 4, torch.float32),  # fast, scalar loads, long rows
    (65, 700, 3, torch.float32),  # general: D > 512
    (200, 384, 64, torch.float32),  # general: parameters exceed shared memory
    (500, 16, 3, torch.float64),  # fast, float64
    (1, 1, 1, torch.float32),  # smallest
    (300001, 16, 3, torch.float32),  # several rows per thread: the prefetching loop
    (200003, 5, 2, torch.float32),  # the same, scalar loads
]


def main():
    torch.manual_seed(0)
    failures = 0
    for n, d, k, dtype in CASES:
        opts = dict(device="cuda", dtype=dtype)
        x = torch.randn(n, d, **opts) * 3
        w = torch.rand(k, **opts) + 0.1
        mu = torch.randn(k, d, **opts) * 2
        sd = torch.rand(k, d, **opts) + 0.5
        qm = torch.randn(d, **opts)
        qs = torch.rand(d, **opts) * 2 + 2
        got = fused_ops.importance_sampling(x, w, mu, sd, qm, qs)
        want = reference.importance_sampling(x, w, mu, sd, qm, qs)
        ok = all(torch.allclose(g, r, atol=1e-4, rtol=1e-4) for g, r in zip(got, want))
        failures += not ok
        print(f"N={n} D={d} K={k} {dtype}: {'ok' if ok else 'MISMATCH'}")
    torch.cuda.synchronize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
