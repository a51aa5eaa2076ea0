"""A small CUDA run of every kernel path, for compute-sanitizer.

    compute-sanitizer --tool memcheck python bench/sanitize_run.py [group ...]

(groups: importance_sampling, importance_sampling_backward, flow, flow_backward,
vae, vae_backward; all by default).

Covers, for importance_sampling, the vectorised and scalar fast paths (short
and long rows), the general path (D > 512, and parameters too large for shared
memory) and float64; for flow_euler, the split (4 and 2 blocks per row) and
row paths (the default D and H), the cluster path (sm_90, B <= 32), the
3xTF32 tile path (ragged last tile, D and H not multiples of 8 or 32), the
wgmma path (the large-batch default on an sm_90a build) and the general path
(float64; float32 too large for both); for vae_elbo, the cluster, wgmma,
tiled and general paths (VAE_CASES) and the backward (VAE_BWD_CASES).  Each
result is checked against the reference so a silent error also fails.

For importance_sampling_backward: tiles of 32 and 256 samples (several per
block), long rows (more gradient entries than threads), large K (coefficients
in global memory), float64, absent upstream gradients; checked against the
reference's autograd.
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
    (8, 64, 256, 4, torch.float32),  # split (4 blocks per row), default size
    (3, 64, 256, 2, torch.float32),  # split (4)
    (40, 64, 256, 3, torch.float32),  # split (2 blocks per row)
    (70, 64, 256, 1, torch.float32),  # row
    (3, 5, 20, 2, torch.float32),  # cluster, everything padded
    (32, 100, 130, 2, torch.float32),  # cluster, 4 row chunks, ragged neuron slices
    (1, 1, 3, 1, torch.float32),  # cluster, smallest
    (32, 64, 300, 2, torch.float32),  # cluster, long ragged k-segments
    (129, 100, 130, 2, torch.float32),  # tiled, ragged last tile, padded K
    (4096, 64, 256, 2, torch.float32),  # wgmma on an sm_90a build (tiled otherwise), the large-batch default
    (40, 3, 300, 1, torch.float32),  # tiled, two column passes
    (8, 5, 1100, 1, torch.float32),  # general: too large for cluster and tile
    (37, 6, 33, 2, torch.float64),  # general, float64
]


def flow_inputs(b, d, h, dtype):
    """x0, w1, b1, w2, b2, w3, b3 of a flow problem, weights at nn.Linear's scale."""
    opts = dict(device="cuda", dtype=dtype)
    x0 = torch.randn(b, d, **opts)
    w1 = (torch.rand(h, d + 1, **opts) * 2 - 1) / (d + 1) ** 0.5
    w2 = (torch.rand(h, h, **opts) * 2 - 1) / h**0.5
    w3 = (torch.rand(d, h, **opts) * 2 - 1) / h**0.5
    b1, b2, b3 = (torch.rand(n, **opts) * 0.2 - 0.1 for n in (h, h, d))
    return x0, w1, b1, w2, b2, w3, b3


def run_flow():
    torch.manual_seed(0)
    failures = 0
    for b, d, h, steps, dtype in FLOW_CASES:
        args = flow_inputs(b, d, h, dtype)
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
    (128, 784, 256, 32, torch.float32),  # cluster, float4 weight reads, 8-CTA clusters (the default size)
    (16, 784, 256, 32, torch.float32),  # cluster, one 16-CTA cluster
    (300, 64, 128, 8, torch.float32),  # cluster, more tiles than resident clusters (un-pipelined kernel)
    (37, 1000, 130, 17, torch.float32),  # cluster, scalar reads, partial row tile
    (5, 5, 7, 3, torch.float32),  # cluster, slices smaller than the cluster (empty CTAs)
    (2053, 784, 256, 32, torch.float32),  # wgmma (sm_90a build), partial last tile
    (2048, 130, 256, 17, torch.float32),  # wgmma, a full decoder pass and a tail pass
    (2048, 37, 40, 5, torch.float32),  # tiled, odd I and L
    (2048, 784, 256, 64, torch.float32),  # tiled, shared memory above 200 KB
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


FLOW_BACKWARD_CASES = [
    # (B, D, H, num_steps, dtype)    what it exercises
    (8, 64, 256, 4, torch.float32),  # resident mode, one column-sum chunk
    (300, 5, 37, 3, torch.float32),  # streaming, two chunks (the last ragged), ragged column tiles
    (4096, 64, 256, 2, torch.float32),  # streaming, 16 chunks
    (1, 1, 3, 1, torch.float32),  # resident, smallest, a single step
    (37, 6, 33, 3, torch.float64),  # resident, float64
    (70, 6, 33, 8, torch.float64),  # streaming, float64
    (0, 4, 9, 2, torch.float32),  # empty batch: zero weight gradients
]


IS_BACKWARD_CASES = [
    # (N, D, K, dtype, upstream grads (mean, ess, log_weights))   path exercised
    (4096, 16, 3, torch.float32, (1, 1, 1)),  # default: tiles of 32, entries over sample slices
    (1000003, 5, 3, torch.float32, (1, 1, 1)),  # tiles of 256, several tiles per block
    (129, 700, 3, torch.float32, (1, 0, 1)),  # entries > threads: one thread per entry, strided
    (50, 2, 400, torch.float32, (0, 1, 0)),  # coefficients in global memory (large K)
    (777, 3, 2, torch.float64, (1, 1, 1)),  # float64
    (1, 1, 1, torch.float32, (1, 1, 1)),  # smallest
    (300, 4, 3, torch.float32, (0, 0, 1)),  # log_weights gradient only
]


def is_inputs(n, d, k, dtype, device="cuda"):
    """samples, mix_weights, mix_mus, mix_stds, q_mu, q_std of an importance-sampling problem."""
    opts = dict(device=device, dtype=dtype)
    x = torch.randn(n, d, **opts) * 3
    w = torch.rand(k, **opts) + 0.1
    mu = torch.randn(k, d, **opts) * 2
    sd = torch.rand(k, d, **opts) + 0.5
    qm = torch.randn(d, **opts)
    qs = torch.rand(d, **opts) * 2 + 2
    return x, w, mu, sd, qm, qs


def run_is_backward():
    """fused_ops::importance_sampling_backward (one cooperative launch),
    checked against the reference's autograd."""
    torch.manual_seed(0)
    failures = 0
    bwd = torch.ops.fused_ops.importance_sampling_backward.default
    for n, d, k, dtype, which in IS_BACKWARD_CASES:
        opts = dict(device="cuda", dtype=dtype)
        args = [t.requires_grad_() for t in is_inputs(n, d, k, dtype)]
        ups = [torch.randn(d, **opts), torch.randn((), **opts), torch.randn(n, **opts) / n**0.5]
        ups = [u if use else None for u, use in zip(ups, which)]
        with torch.no_grad():
            out = fused_ops.importance_sampling(*args)
        got = bwd(*ups, *[a.detach() for a in args], out[0], out[2])
        ref_out = reference.importance_sampling(*args)
        loss = sum((o * u).sum() for o, u in zip(ref_out, ups) if u is not None)
        want = torch.autograd.grad(loss, args, allow_unused=True)
        ok = True
        for g, r in zip(got, want):
            r = torch.zeros_like(g) if r is None else r
            scale = max(r.abs().max().item(), 1e-3)
            ok &= bool(torch.isfinite(g).all()) and torch.allclose(g, r, rtol=1e-3, atol=1e-3 * scale)
        failures += not ok
        print(f"IS backward N={n} D={d} K={k} {dtype} grads={which}: {'ok' if ok else 'MISMATCH'}")
    torch.cuda.synchronize()
    return failures


def run_flow_backward():
    torch.manual_seed(0)
    failures = 0
    for b, d, h, steps, dtype in FLOW_BACKWARD_CASES:
        args = [t.requires_grad_() for t in flow_inputs(b, d, h, dtype)]
        upstream = torch.randn(b, d, device="cuda", dtype=dtype)
        got = torch.autograd.grad(fused_ops.flow_euler(*args, steps), args, upstream)
        want = torch.autograd.grad(reference.flow_euler(*args, steps), args, upstream)
        ok = all(torch.allclose(g, r, atol=1e-4, rtol=1e-4) for g, r in zip(got, want))
        failures += not ok
        print(f"flow backward B={b} D={d} H={h} steps={steps} {dtype}: {'ok' if ok else 'MISMATCH'}")
    torch.cuda.synchronize()
    return failures


# vae_elbo_backward (csrc/cuda/vae_elbo_backward.cu: the persistent one-launch
# path up to 1.5e9 multiply-adds, else cuBLAS products plus elementwise and
# column-sum kernels): (B, I, H, L, dtype, upstreams).
VAE_BWD_CASES = [
    (128, 784, 256, 32, torch.float32, ("elbo", "recon", "kl")),  # default size
    (2048, 784, 256, 32, torch.float32, ("elbo",)),  # cuBLAS path
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


def run_importance_sampling():
    failures = 0
    for n, d, k, dtype in CASES:
        args = is_inputs(n, d, k, dtype)
        got = fused_ops.importance_sampling(*args)
        want = reference.importance_sampling(*args)
        ok = all(torch.allclose(g, r, atol=1e-4, rtol=1e-4) for g, r in zip(got, want))
        failures += not ok
        print(f"N={n} D={d} K={k} {dtype}: {'ok' if ok else 'MISMATCH'}")
    torch.cuda.synchronize()
    return failures


GROUPS = {
    "importance_sampling": run_importance_sampling,
    "importance_sampling_backward": run_is_backward,
    "flow": run_flow,
    "flow_backward": run_flow_backward,
    "vae": run_vae,
    "vae_backward": run_vae_backward,
}


def main(argv):
    """Runs the named groups (all by default); exit status 1 on any mismatch."""
    names = argv or list(GROUPS)
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        sys.exit(f"unknown groups {unknown}; choose from {list(GROUPS)}")
    failures = 0
    for name in names:
        torch.manual_seed(0)
        failures += GROUPS[name]()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
