"""A small CUDA run of every kernel path, for compute-sanitizer.

    compute-sanitizer --tool memcheck python bench/sanitize_run.py

Covers, for importance_sampling, the vectorised and scalar fast paths (short
and long rows), the general path (D > 512, and parameters too large for shared
memory) and float64; for flow_euler, the cluster path (sm_90, B <= 32), the
3xTF32 tile path (ragged last tile, D and H not multiples of 8 or 32) and the
general path (float64; float32 too large for both); for vae_elbo, the cluster,
tiled and general paths (VAE_CASES) and the backward (VAE_BWD_CASES).  Each result is checked against the
reference so a silent error also fails.
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


FLOW_CASES = [
    # (B, D, H, num_steps, dtype)    path exercised
    (8, 64, 256, 4, torch.float32),  # cluster, default size
    (3, 5, 20, 2, torch.float32),  # cluster, everything padded
    (32, 100, 130, 2, torch.float32),  # cluster, 4 row chunks, ragged neuron slices
    (1, 1, 3, 1, torch.float32),  # cluster, smallest
    (129, 100, 130, 2, torch.float32),  # tiled, ragged last tile, padded K
    (4096, 64, 256, 2, torch.float32),  # tiled, the large-batch default
    (40, 3, 300, 1, torch.float32),  # tiled, two column passes
    (8, 5, 1100, 1, torch.float32),  # general: too large for cluster and tile
    (37, 6, 33, 2, torch.float64),  # general, float64
]


def run_flow():
    torch.manual_seed(0)
    failures = 0
    for b, d, h, steps, dtype in FLOW_CASES:
        opts = dict(device="cuda", dtype=dtype)
        x0 = torch.randn(b, d, **opts)
        w1 = (torch.rand(h, d + 1, **opts) * 2 - 1) / (d + 1) ** 0.5
        w2 = (torch.rand(h, h, **opts) * 2 - 1) / h**0.5
        w3 = (torch.rand(d, h, **opts) * 2 - 1) / h**0.5
        b1, b2, b3 = (torch.rand(n, **opts) * 0.2 - 0.1 for n in (h, h, d))
        args = (x0, w1, b1, w2, b2, w3, b3)
        got = fused_ops.flow_euler(*args, steps)
        want = reference.flow_euler(*args, steps)
        ok = torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        failures += not ok
        print(f"flow B={b} D={d} H={h} steps={steps} {dtype}: {'ok' if ok else 'MISMATCH'}")
    torch.cuda.synchronize()
    return failures


# vae_elbo: (B, I, H, L, dtype) and the CUDA path it takes on an sm_90 GPU
# (csrc/cuda/vae_elbo.cu documents the rule).  Small batches where possible:
# the sanitizer slows kernels down by orders of magnitude.
VAE_CASES = [
    (128, 784, 256, 32, torch.float32),  # cluster, float4 weight reads (the default size)
    (37, 1000, 130, 17, torch.float32),  # cluster, scalar reads, partial row tile
    (5, 5, 7, 3, torch.float32),  # cluster, slices smaller than the cluster (empty CTAs)
    (2053, 784, 256, 32, torch.float32),  # tiled tensor-core path, partial last tile
    (2048, 37, 40, 5, torch.float32),  # tiled, odd I and L
    (3, 4000, 1500, 40, torch.float32),  # general: activations exceed shared memory
    (9, 33, 16, 5, torch.float64),  # general: float64
]


def vae_inputs(b, i, h, l_, dtype):
    opts = dict(device="cuda", dtype=dtype)

    def linear(n_out, n_in):
        bound = 2.0 / n_in**0.5
        return (torch.rand(n_out, n_in, **opts) * 2 - 1) * bound, (torch.rand(n_out, **opts) * 2 - 1) * bound

    return [torch.rand(b, i, **opts), torch.randn(b, l_, **opts),
            *linear(h, i), *linear(l_, h), *linear(l_, h), *linear(h, l_), *linear(i, h)]


def run_vae():
    failures = 0
    for b, i, h, l_, dtype in VAE_CASES:
        args = vae_inputs(b, i, h, l_, dtype)
        got = fused_ops.vae_elbo(*args)
        ref = reference.VAE(i, h, l_).to(device="cuda", dtype=dtype)
        with torch.no_grad():
            for p, v in zip(ref.parameters(), args[2:]):
                p.copy_(v)
            want = ref(args[0], args[1])
        ok = all(torch.allclose(g, r, atol=1e-4, rtol=1e-4) for g, r in zip(got, want))
        failures += not ok
        print(f"vae_elbo B={b} I={i} H={h} L={l_} {dtype}: {'ok' if ok else 'MISMATCH'}")
    return failures


# vae_elbo_backward (csrc/cuda/vae_elbo_backward.cu: one path, cuBLAS products
# plus elementwise and column-sum kernels): (B, I, H, L, dtype, upstreams).
VAE_BWD_CASES = [
    (128, 784, 256, 32, torch.float32, ("elbo", "recon", "kl")),  # default size
    (37, 1000, 130, 17, torch.float32, ("elbo",)),  # odd sizes, partial column-sum blocks
    (5, 5, 7, 3, torch.float32, ("kl",)),  # tiny; recon upstream None
    (70, 33, 16, 5, torch.float64, ("recon", "kl")),  # float64; elbo upstream None
    (0, 6, 5, 3, torch.float32, ("elbo",)),  # empty batch: zero weight gradients
]


def run_vae_backward():
    failures = 0
    names = ("elbo", "recon", "kl")
    for b, i, h, l_, dtype, used in VAE_BWD_CASES:
        args = [t.requires_grad_() for t in vae_inputs(b, i, h, l_, dtype)]
        ups = {n: torch.randn(b, device="cuda", dtype=dtype) for n in used}
        out = dict(zip(names, fused_ops.vae_elbo(*args)))
        got = torch.autograd.grad([out[n] for n in used], args, [ups[n] for n in used])
        ref = reference.VAE(i, h, l_).to(device="cuda", dtype=dtype)
        pnames = [n for n, _ in ref.named_parameters()]
        rout = dict(zip(names, torch.func.functional_call(ref, dict(zip(pnames, args[2:])),
                                                          (args[0], args[1]))))
        want = torch.autograd.grad([rout[n] for n in used], args, [ups[n] for n in used],
                                   allow_unused=True, materialize_grads=True)
        ok = True
        for g, r in zip(got, want):
            scale = r.abs().max().item() if r.numel() else 1.0
            ok &= torch.allclose(g, r, atol=1e-5 * max(scale, 1e-3), rtol=1e-4)
        failures += not ok
        print(f"vae_elbo backward B={b} I={i} H={h} L={l_} {dtype} {used}: "
              f"{'ok' if ok else 'MISMATCH'}")
    torch.cuda.synchronize()
    return failures


def main():
    torch.manual_seed(0)
    failures = run_vae()
    failures += run_vae_backward()
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
    failures += run_flow()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
