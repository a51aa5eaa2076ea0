"""Every CUDA kernel path of every op, forward and backward, on small inputs: the
workload compute-sanitizer runs.

    compute-sanitizer --tool memcheck python tools/sanitize_run.py [op ...]
    python tools/sanitize_run.py --list        # the cases, and the paths of this build

Ops: importance_sampling, flow_euler, vae_elbo, snis, ode_mlp, vae_mlp_elbo, importance_log_weights and
their ``_backward`` ops, resample, and matmul, the products under the kernels (all by default; ``flow``,
``vae``, ``ode``, ``vae_mlp`` and ``ilw`` name both directions of those ops).

For each op the kernel-path table of this build (``fused_ops._paths``) gives
the paths.  Each case below names the path(s) it is meant for; a case is run
with that path forced (``_paths.force``) and then reports the path the call
took (``_paths.last``).  A case whose path's condition does not hold on this
device or build (the forced call refuses to run) is skipped and said so.  A
path that no case names is tried on the op's cases, smallest first, until one
applies.  Cases named ``NATURAL`` run unforced (the table's own choice).  A
path that ran on no case at all is a failure, and so is any result that
differs from the reference (``fused_ops.reference``), so a silent error fails
too.  Exit status: 0 when every path ran and every result matched.

The sizes are small where the path allows it: the sanitizer slows kernels by
orders of magnitude.  A build without path tables runs every case unforced.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import fused_ops  # noqa: E402
from fused_ops import reference  # noqa: E402

try:
    from fused_ops import _paths
except ImportError:  # a build without the kernel-path debug hook
    _paths = None

NATURAL = "natural"
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


@dataclass(frozen=True)
class Case:
    paths: Tuple[str, ...]  # the paths this case is meant for, or (NATURAL,)
    size: tuple  # op-specific, see the op's runner
    note: str = ""

    def cost(self) -> int:
        """Elements of the problem: the order in which uncovered paths try cases."""
        n = 1
        for v in self.size:
            if isinstance(v, int):
                n *= max(v, 1)
        return n


def case(paths, *size, note=""):
    return Case(tuple(paths.split()), tuple(size), note)


# ----------------------------------------------------------------------------
# Inputs and runners: each runner calls the fused op on a case and returns
# whether it matches the reference.
# ----------------------------------------------------------------------------


def is_inputs(n, d, k, dtype):
    """samples, mix_weights, mix_mus, mix_stds, q_mu, q_std of an importance-sampling problem."""
    opts = dict(device="cuda", dtype=dtype)
    return (torch.randn(n, d, **opts) * 3, torch.rand(k, **opts) + 0.1, torch.randn(k, d, **opts) * 2,
            torch.rand(k, d, **opts) + 0.5, torch.randn(d, **opts), torch.rand(d, **opts) * 2 + 2)


def flow_inputs(b, d, h, dtype):
    """x0, w1, b1, w2, b2, w3, b3 of a flow problem, weights at nn.Linear's scale."""
    opts = dict(device="cuda", dtype=dtype)
    x0 = torch.randn(b, d, **opts)
    w1 = (torch.rand(h, d + 1, **opts) * 2 - 1) / (d + 1) ** 0.5
    w2 = (torch.rand(h, h, **opts) * 2 - 1) / h**0.5
    w3 = (torch.rand(d, h, **opts) * 2 - 1) / h**0.5
    b1, b2, b3 = (torch.rand(n, **opts) * 0.2 - 0.1 for n in (h, h, d))
    return [x0, w1, b1, w2, b2, w3, b3]


def vae_inputs(b, i, h, l_, dtype):
    """x, eps and the ten weights and biases of a VAE problem (nn.Linear's layout and scale)."""
    opts = dict(device="cuda", dtype=dtype)

    def linear(n_out, n_in):
        bound = 2.0 / n_in**0.5
        return (torch.rand(n_out, n_in, **opts) * 2 - 1) * bound, (torch.rand(n_out, **opts) * 2 - 1) * bound

    return [torch.rand(b, i, **opts), torch.randn(b, l_, **opts),
            *linear(h, i), *linear(l_, h), *linear(l_, h), *linear(h, l_), *linear(i, h)]


def close(got, want, atol=1e-4, rtol=1e-4):
    return all(torch.allclose(g, w, atol=atol, rtol=rtol) for g, w in zip(got, want))


def run_is(n, d, k, dtype):
    args = is_inputs(n, d, k, dtype)
    return close(fused_ops.importance_sampling(*args), reference.importance_sampling(*args))


def run_is_backward(n, d, k, dtype, which):
    """The backward op directly, with some upstream gradients absent (``which``:
    mean, ess, log_weights), against the reference's autograd: close to the
    same-dtype reference, or no further from a float64 run of the reference
    than twice the same-dtype reference is (at long rows the float32
    reference's own gradients are the less accurate side)."""
    opts = dict(device="cuda", dtype=dtype)
    inputs = is_inputs(n, d, k, dtype)
    ups = [torch.randn(d, **opts), torch.randn((), **opts), torch.randn(n, **opts) / n**0.5]
    ups = [u if use else None for u, use in zip(ups, which)]
    with torch.no_grad():
        out = fused_ops.importance_sampling(*inputs)
    got = torch.ops.fused_ops.importance_sampling_backward.default(*ups, *inputs, out[0], out[2])

    def reference_grads(cast):
        args = [cast(t).requires_grad_() for t in inputs]
        loss = sum((o * cast(u)).sum() for o, u in zip(reference.importance_sampling(*args), ups) if u is not None)
        return [torch.zeros_like(a) if g is None else g
                for a, g in zip(args, torch.autograd.grad(loss, args, allow_unused=True))]

    want = reference_grads(lambda t: t.detach().clone())
    want64 = reference_grads(lambda t: t.detach().double())
    ok = True
    for g, r, r64 in zip(got, want, want64):
        scale = max(r64.abs().max().item(), 1e-3)
        near_reference = torch.allclose(g, r, rtol=1e-3, atol=1e-3 * scale)
        err, ref_err = (g.double() - r64).abs().max().item(), (r.double() - r64).abs().max().item()
        ok &= bool(torch.isfinite(g).all()) and (near_reference or err <= 2 * ref_err + 1e-5 * scale)
    return ok


def run_flow(b, d, h, steps, dtype):
    args = flow_inputs(b, d, h, dtype)
    return close([fused_ops.flow_euler(*args, steps)], [reference.flow_euler(*args, steps)])


def run_flow_backward(b, d, h, steps, dtype):
    args = [t.requires_grad_() for t in flow_inputs(b, d, h, dtype)]
    upstream = torch.randn(b, d, device="cuda", dtype=dtype)
    got = torch.autograd.grad(fused_ops.flow_euler(*args, steps), args, upstream)
    want = torch.autograd.grad(reference.flow_euler(*args, steps), args, upstream)
    return close(got, want)


def vae_reference_outputs(args, i, h, l_, dtype):
    ref = reference.VAE(i, h, l_).to(device="cuda", dtype=dtype)
    names = [n for n, _ in ref.named_parameters()]
    return torch.func.functional_call(ref, dict(zip(names, args[2:])), (args[0], args[1]))


def run_vae(b, i, h, l_, dtype):
    if dtype == BF16:  # against float64 on the same values, a few bfloat16 ulps of each output's scale
        args = [a.to(BF16) for a in vae_inputs(b, i, h, l_, F32)]
        got = fused_ops.vae_elbo(*args)
        with torch.no_grad():
            want = vae_reference_outputs([a.double() for a in args], i, h, l_, F64)
        eps = torch.finfo(BF16).eps
        return all(g.dtype == BF16 and torch.allclose(g.double(), w, atol=4 * eps * max(w.abs().max().item(), 1.0),
                                                      rtol=0) for g, w in zip(got, want))
    args = vae_inputs(b, i, h, l_, dtype)
    got = fused_ops.vae_elbo(*args)
    with torch.no_grad():
        want = vae_reference_outputs(args, i, h, l_, dtype)
    return close(got, want)


def run_vae_backward(b, i, h, l_, dtype, used):
    """Gradients of the named outputs (the others' upstream gradients absent)."""
    names = ("elbo", "recon", "kl")
    args = [t.requires_grad_() for t in vae_inputs(b, i, h, l_, dtype)]
    ups = {n: torch.randn(b, device="cuda", dtype=dtype) for n in used}
    # The op itself: its autograd runs vae_elbo_backward at every size
    # (fused_ops.vae_elbo takes the training pair at large batches).
    out = dict(zip(names, torch.ops.fused_ops.vae_elbo(*args)))
    got = torch.autograd.grad([out[n] for n in used], args, [ups[n] for n in used])
    rout = dict(zip(names, vae_reference_outputs(args, i, h, l_, dtype)))
    want = torch.autograd.grad([rout[n] for n in used], args, [ups[n] for n in used],
                               allow_unused=True, materialize_grads=True)
    ok = True
    for g, r in zip(got, want):
        scale = r.abs().max().item() if r.numel() else 1.0
        ok &= torch.allclose(g, r, atol=1e-5 * max(scale, 1e-3), rtol=1e-4)
    return ok


def vae_activations(args):
    """h, [mu | logvar], z, g and the logits of a VAE problem: the sections of
    vae_elbo_train's saved buffer (csrc/vae_elbo.h, VaeSavedLayout), flat."""
    x, eps, w_enc, b_enc, w_mu, b_mu, w_lv, b_lv, w_d1, b_d1, w_d2, b_d2 = args
    linear = torch.nn.functional.linear
    h = torch.relu(linear(x, w_enc, b_enc))
    mu, lv = linear(h, w_mu, b_mu), linear(h, w_lv, b_lv)
    z = mu + torch.exp(0.5 * lv) * eps
    g = torch.relu(linear(z, w_d1, b_d1))
    return [t.reshape(-1) for t in (h, torch.cat([mu, lv], 1), z, g, linear(g, w_d2, b_d2))]


def run_vae_train(b, i, h, l_, dtype):
    """vae_elbo_train: its losses vae_elbo's, its saved activations the
    reference's."""
    args = vae_inputs(b, i, h, l_, dtype)
    *losses, saved = torch.ops.fused_ops.vae_elbo_train(*args)
    ok = close(losses, torch.ops.fused_ops.vae_elbo(*args))
    want = torch.cat(vae_activations(args)) if b else saved.new_empty(0)
    return ok and close([saved], [want])


def run_vae_train_backward(b, i, h, l_, dtype, used, grad_x):
    """vae_elbo_train_backward on vae_elbo_train's buffer, some upstream
    gradients absent, with or without x's gradient, against vae_elbo_backward."""
    args = vae_inputs(b, i, h, l_, dtype)
    ups = [torch.randn(b, device="cuda", dtype=dtype) if n in used else None for n in ("elbo", "recon", "kl")]
    saved = torch.ops.fused_ops.vae_elbo_train(*args)[3]
    got = torch.ops.fused_ops.vae_elbo_train_backward(*ups, *args, saved, grad_x)
    want = torch.ops.fused_ops.vae_elbo_backward(*ups, *args)
    if not grad_x:
        got, want = got[1:], want[1:]
    return all(torch.allclose(g, w, atol=1e-5 * max(w.abs().max().item() if w.numel() else 1.0, 1e-3), rtol=1e-4)
               for g, w in zip(got, want))


def run_resample(b, n, m, method, dtype):
    """Indices from log weights [b, n] (b None: [n]) with a few zero weights, against the reference."""
    lead = () if b is None else (b,)
    lw = torch.randn(*lead, n, dtype=dtype, device="cuda") * 2
    if n > 1:
        lw[..., 1::7] = float("-inf")
    u = torch.rand(*lead, 1 if method == "systematic" else m, dtype=F64, device="cuda")
    return torch.equal(fused_ops.resample(lw, m, method, uniforms=u), reference.resample(lw, u, m, method))


def ode_inputs(b, d, widths, steps, dtype):
    """x0, t, weights, biases of an MLP velocity field (time last), nn.Linear's scale."""
    opts = dict(device="cuda", dtype=dtype)
    dims = [d + 1, *widths, d]
    ws = [(torch.rand(o, i, **opts) * 2 - 1) / i**0.5 for i, o in zip(dims[:-1], dims[1:])]
    bs = [torch.rand(o, **opts) * 0.2 - 0.1 for o in dims[1:]]
    return torch.randn(b, d, **opts), torch.linspace(0, 1, steps + 1, **opts), ws, bs


def run_ode(b, d, widths, steps, method, dtype):
    x0, t, ws, bs = ode_inputs(b, d, widths, steps, dtype)
    got = fused_ops.odeint_mlp(x0, t, ws, bs, method=method, activation="silu")
    want = fused_ops.ops.odeint_fixed(fused_ops.ops._ode.mlp_velocity(ws, bs, "silu"), x0, t, method)
    return close([got], [want])


def run_ode_backward(b, d, widths, steps, method, dtype):
    x0, t, ws, bs = ode_inputs(b, d, widths, steps, dtype)
    args = [x0.requires_grad_(), *(w.requires_grad_() for w in ws), *(v.requires_grad_() for v in bs)]
    up = torch.randn(steps + 1, b, d, device="cuda", dtype=dtype)
    got = torch.autograd.grad(fused_ops.odeint_mlp(x0, t, ws, bs, method=method), args, up)
    ref = fused_ops.ops.odeint_fixed(fused_ops.ops._ode.mlp_velocity(ws, bs, "silu"), x0, t, method)
    want = torch.autograd.grad(ref, args, up)
    return close(got, want, atol=1e-4, rtol=1e-3)


def vae_mlp_inputs(b, i, enc, l_, dec, dtype):
    """x, eps and the weight lists of a VAE of MLPs (nn.Linear's scale), a [mu | logvar] head."""
    opts = dict(device="cuda", dtype=dtype)

    def chain(dims):
        ws = [(torch.rand(o, n, **opts) * 2 - 1) / n**0.5 for n, o in zip(dims[:-1], dims[1:])]
        return ws, [torch.rand(o, **opts) * 0.2 - 0.1 for o in dims[1:]]

    ew, eb = chain([i, *enc])
    (wh,), (bh,) = chain([enc[-1], 2 * l_])
    dw, db = chain([l_, *dec, i])
    return torch.rand(b, i, **opts), torch.randn(b, l_, **opts), ew, eb, wh, bh, dw, db


def vae_mlp_plain(x, eps, ew, eb, wh, bh, dw, db):
    """The SiLU, Gaussian (MSE sum) VAE the runners call, in plain PyTorch."""
    F = torch.nn.functional
    h = x
    for w, v in zip(ew, eb):
        h = F.silu(F.linear(h, w, v))
    mu, logvar = F.linear(h, wh, bh).chunk(2, -1)
    g = mu + torch.exp(0.5 * logvar) * eps
    for w, v in zip(dw[:-1], db[:-1]):
        g = F.silu(F.linear(g, w, v))
    recon = F.mse_loss(F.linear(g, dw[-1], db[-1]), x, reduction="none").sum(-1)
    kl = -0.5 * (1 + logvar - mu**2 - torch.exp(logvar)).sum(-1)
    return -(recon + kl), recon, kl


def run_vae_mlp(b, i, enc, l_, dec, dtype):
    args = vae_mlp_inputs(b, i, enc, l_, dec, dtype)
    got = fused_ops.vae_mlp_elbo(*args, activation="silu", likelihood="gaussian")
    return close(got, vae_mlp_plain(*args), atol=1e-3, rtol=1e-4)


def run_vae_mlp_backward(b, i, enc, l_, dec, dtype):
    x, eps, ew, eb, wh, bh, dw, db = vae_mlp_inputs(b, i, enc, l_, dec, dtype)
    flat = [t.requires_grad_() for t in (x, eps, *ew, *eb, wh, bh, *dw, *db)]
    up = [torch.randn(b, device="cuda", dtype=dtype) for _ in range(3)]
    got = fused_ops.vae_mlp_elbo(x, eps, ew, eb, wh, bh, dw, db, activation="silu", likelihood="gaussian")
    want = vae_mlp_plain(x, eps, ew, eb, wh, bh, dw, db)
    g = torch.autograd.grad(got, flat, up)
    w = torch.autograd.grad(want, flat, up)
    return close(g, w, atol=1e-3, rtol=1e-3)


# ----------------------------------------------------------------------------
# The cases.  Sizes: importance sampling (N, D, K, dtype[, upstreams]); flow
# (B, D, H, num_steps, dtype); VAE (B, I, H, L, dtype[, upstreams]); resample
# (B or None, N, M, method, dtype).  Path
# conditions: each op's table (python -c "from fused_ops import _paths;
# print(_paths.table('flow_euler'))") and docs/<op>.md.
# ----------------------------------------------------------------------------

IS_CASES = [
    case("fast", 1000, 16, 3, F32, note="float4 loads, 4 lanes per row"),
    case("fast", 777, 3, 2, F32, note="scalar loads"),
    case("fast", 300, 200, 5, F32, note="float4 loads, long rows"),
    case("fast", 129, 101, 4, F32, note="scalar loads, long rows"),
    case("fast", 500, 16, 3, F64, note="float64"),
    case("fast", 1, 1, 1, F32, note="smallest"),
    case("fast", 300001, 16, 3, F32, note="several rows per thread: the prefetching loop"),
    case("fast", 200003, 5, 2, F32, note="the same, scalar loads"),
    case("general", 65, 700, 3, F32, note="D > 512"),
    case("general", 200, 384, 64, F32, note="parameters exceed shared memory"),
    case("general", 1000, 16, 3, F32, note="forced at a size the fast path takes"),
]

IS_BACKWARD_CASES = [  # one path ("tiled"): every case takes it
    case(NATURAL, 4096, 16, 3, F32, (1, 1, 1), note="the default size"),
    case(NATURAL, 1000003, 5, 3, F32, (1, 1, 1), note="several sample tiles per block"),
    case(NATURAL, 129, 700, 3, F32, (1, 0, 1), note="more gradient entries than threads"),
    case(NATURAL, 50, 2, 400, F32, (0, 1, 0), note="large K: coefficients in global memory"),
    case(NATURAL, 777, 3, 2, F64, (1, 1, 1), note="float64"),
    case(NATURAL, 1, 1, 1, F32, (1, 1, 1), note="smallest"),
    case(NATURAL, 300, 4, 3, F32, (0, 0, 1), note="log_weights gradient only"),
]

FLOW_CASES = [
    case("split", 8, 64, 256, 4, F32, note="4 blocks per row, the default size"),
    case("split", 3, 64, 256, 2, F32, note="4 blocks per row"),
    case("split", 40, 64, 256, 3, F32, note="2 blocks per row"),
    case("row", 70, 64, 256, 1, F32, note="one block per row"),
    case("row", 8, 64, 256, 2, F32, note="forced at the default size"),
    case("cluster", 3, 5, 20, 2, F32, note="everything padded"),
    case("cluster", 32, 100, 130, 2, F32, note="4 row chunks, ragged neuron slices"),
    case("cluster", 1, 1, 3, 1, F32, note="smallest"),
    case("cluster", 32, 64, 300, 2, F32, note="long ragged k-segments"),
    case("wgmma", 4096, 64, 256, 2, F32, note="the large-batch default (sm_90a build)"),
    case("wgmma", 300, 64, 256, 1, F32, note="a ragged last tile"),
    case("tiled", 129, 100, 130, 2, F32, note="ragged last tile, padded K"),
    case("tiled", 40, 3, 300, 1, F32, note="two column passes"),
    case("tiled", 300, 64, 256, 1, F32, note="the default D and H"),
    case("general", 8, 5, 1100, 1, F32, note="too large for the cluster and tile paths"),
    case("general", 37, 6, 33, 2, F64, note="float64"),
    case("general", 8, 64, 256, 2, F32, note="forced at the default size"),
]

FLOW_BACKWARD_CASES = [
    case("resident", 8, 64, 256, 4, F32, note="the default size"),
    case("resident", 1, 1, 3, 1, F32, note="smallest, a single step"),
    case("resident", 37, 6, 33, 3, F64, note="float64"),
    case("streaming", 300, 5, 37, 3, F32, note="two chunks, the last ragged; ragged column tiles"),
    case("streaming", 4096, 64, 256, 2, F32, note="16 chunks"),
    case("streaming", 70, 6, 33, 8, F64, note="float64"),
    case("streaming", 8, 64, 256, 4, F32, note="forced at the default size"),
    case(NATURAL, 0, 4, 9, 2, F32, note="empty batch: zero weight gradients"),
]

VAE_CASES = [
    case("cluster", 128, 784, 256, 32, F32, note="8-CTA clusters, float4 weight reads (the default size)"),
    case("cluster", 16, 784, 256, 32, F32, note="one 16-CTA cluster"),
    case("cluster", 300, 64, 128, 8, F32, note="more tiles than resident clusters"),
    case("cluster", 37, 1000, 130, 17, F32, note="scalar reads, partial row tile"),
    case("cluster", 5, 5, 7, 3, F32, note="slices smaller than the cluster (empty CTAs)"),
    case("tiled_bf16", 2048, 37, 16, 5, BF16, note="bfloat16, the smallest batch it takes, odd I and L"),
    case("tiled_bf16", 2053, 100, 64, 20, BF16, note="bfloat16, partial last tile, I past one chunk"),
    case("wgmma", 2053, 784, 256, 32, F32, note="partial last tile (sm_90a build)"),
    case("wgmma", 2048, 130, 256, 17, F32, note="a full decoder pass and a tail pass"),
    case("wgmma", 2048, 20, 256, 8, F32, note="the smallest shape it takes: any I, L <= 32"),
    case("tiled", 2048, 37, 40, 5, F32, note="odd I and L"),
    case("tiled", 2048, 784, 256, 64, F32, note="shared memory above 200 KB"),
    case("tiled", 2048, 20, 64, 8, F32, note="small H and I"),
    case("tiled", 2053, 784, 256, 32, F32, note="forced at a size the wgmma path takes"),
    case("cublas", 2048, 784, 400, 20, F32, note="pytorch/examples' widths"),
    case("cublas", 2053, 37, 40, 5, F64, note="float64, odd sizes"),
    case("general", 3, 4000, 1500, 40, F32, note="activations exceed shared memory"),
    case("general", 9, 33, 16, 5, F64, note="float64"),
    case("general", 128, 784, 256, 32, F32, note="forced at the default size"),
]

VAE_BACKWARD_CASES = [
    case("persistent", 128, 784, 256, 32, F32, ("elbo", "recon", "kl"), note="the default size"),
    case("persistent", 37, 1000, 130, 17, F32, ("elbo",), note="odd sizes, partial column-sum blocks"),
    case("persistent", 5, 5, 7, 3, F32, ("kl",), note="tiny; recon upstream absent"),
    case("persistent", 70, 33, 16, 5, F64, ("recon", "kl"), note="float64; elbo upstream absent"),
    case("cublas", 2048, 784, 256, 32, F32, ("elbo",), note="above the one-launch bound"),
    case("cublas", 37, 1000, 130, 17, F32, ("elbo", "kl"), note="forced at a size the persistent path takes"),
    case(NATURAL, 0, 6, 5, 3, F32, ("elbo",), note="empty batch: zero weight gradients"),
]

VAE_TRAIN_CASES = [
    case("wgmma", 2053, 784, 256, 32, F32, note="partial last tile, every activation stored (sm_90a build)"),
    case("wgmma", 2048, 130, 256, 17, F32, note="a full decoder pass and a tail pass, odd L"),
    case("cublas", 37, 1000, 130, 17, F32, note="a small batch, odd sizes"),
    case("cublas", 70, 33, 16, 5, F64, note="float64"),
    case(NATURAL, 0, 6, 5, 3, F32, note="empty batch"),
]

VAE_TRAIN_BACKWARD_CASES = [
    case("cublas", 2053, 784, 256, 32, F32, ("elbo",), False, note="the training step: no x gradient"),
    case("cublas", 37, 1000, 130, 17, F32, ("elbo", "kl"), True, note="with x's gradient"),
    case("cublas", 70, 33, 16, 5, F64, ("recon", "kl"), False, note="float64; elbo upstream absent"),
    case(NATURAL, 0, 6, 5, 3, F32, ("elbo",), True, note="empty batch: zero weight gradients"),
]

def _snis_inputs(b, n, d, dtype):
    opts = dict(device="cuda", dtype=dtype)
    batch = () if b == -1 else (b,)
    return torch.randn(*batch, n, **opts) * 3, (torch.randn(*batch, n, d, **opts) if d else None)


def run_snis(b, n, d, dtype, moments):
    """snis of log weights [b, n] (b = -1: [n]) and samples [.., n, d] (d = 0: none)."""
    lw, x = _snis_inputs(b, n, d, dtype)
    got = fused_ops.snis(lw, x, moments)
    want = reference.snis(lw, x, moments)
    return close(got, want)


def run_snis_backward(b, n, d, dtype):
    """Every upstream gradient; against the reference's autograd in float64."""
    lw, x = _snis_inputs(b, n, d, dtype)
    lw.requires_grad_()
    x.requires_grad_()
    outs = fused_ops.snis(lw, x, True)
    ups = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, (lw, x), ups)
    args = (lw.detach().double().requires_grad_(), x.detach().double().requires_grad_())
    want = torch.autograd.grad(reference.snis(*args, True), args, [u.double() for u in ups])
    return all(torch.allclose(g.double(), w, rtol=1e-3, atol=1e-4 * max(w.abs().max().item(), 1.0))
               for g, w in zip(got, want))


SNIS_CASES = [  # sizes: (B, N, D, dtype, moments); B = -1: no batch dimension, D = 0: no samples
    case("split", -1, 1 << 16, 3, F32, True, note="one problem in 16 chunks, every pass"),
    case("split", 3, 10007, 0, F32, False, note="log weights only, ragged last chunk"),
    case("split", 2, 9000, 300, F64, True, note="D above a block: two column passes; float64"),
    case("block", 64, 1000, 4, F32, True, note="one block per problem"),
    case("block", 5, 300, 257, F32, True, note="D above a block"),
    case("block", -1, 1, 1, F32, True, note="smallest"),
    case("block", -1, 20000, 2, F32, False, note="forced at a size the split path takes"),
]

SNIS_BACKWARD_CASES = [  # one path ("twopass")
    case(NATURAL, 64, 1000, 4, F32, note="many problems"),
    case(NATURAL, -1, 100003, 3, F32, note="one problem in several chunks"),
    case(NATURAL, -1, 1, 1, F64, note="smallest, float64"),
]

RESAMPLE_CASES = [
    case("block", 64, 4096, 4096, "multinomial", F32, note="a batch, one block per problem"),
    case("block", 3, 5000, 70000, "stratified", F32, note="M > N: several position tiles per CDF tile"),
    case("block", None, 1, 5, "systematic", F32, note="smallest"),
    case("block", 5, 777, 300, "multinomial", F64, note="float64, partial tiles"),
    case("multiblock", None, 300007, 300007, "systematic", F32, note="one big problem, a partial last chunk"),
    case("multiblock", 2, 70001, 5000, "stratified", F64, note="float64, M < N: chunks owning no target"),
    case("multiblock", 3, 65536, 200000, "stratified", F32, note="M > N"),
    case("multiblock", 2, 70001, 30011, "multinomial", F32, note="multinomial: positions written, ranges, merge"),
    case("multiblock", None, 65537, 5, "multinomial", F64, note="multinomial, fewer positions than chunks"),
]

ODE_CASES = [
    case("stepwise", 520, 3, (256, 256), 2, "rk4", F32, note="cuBLAS products, just above the threshold"),
    case("stepwise", 512, 2, (256, 256), 1, "midpoint", F64, note="float64"),
    case("shared", 300, 2, (64, 64, 64), 4, "euler", F32, note="torchcfm-like, a ragged last tile"),
    case("shared", 37, 3, (33, 17), 3, "rk4", F32, note="odd widths, four stages"),
    case("shared", 5, 2, (16,), 2, "heun3", F64, note="float64"),
    case("tiled", 37, 3, (33, 17), 3, "rk4", F32, note="3xTF32 tiles: odd widths, a ragged tile, four stages"),
    case("tiled", 70, 1, (300, 300, 40), 2, "heun3", F32, note="in-place layers of one and two passes"),
    case("tiled", 1, 2, (8,), 2, "euler", F32, note="one row"),
    case("tiled", 40, 2, (512, 512), 1, "midpoint", F32, note="two weight-chunk stages"),
    case("general", 17, 2, (3000, 3000), 1, "midpoint", F32, note="working set beyond shared memory"),
    case("cluster", 3, 2, (33, 17), 2, "rk4", F32, note="one row chunk, ragged slices, four stages"),
    case("cluster", 32, 5, (300,), 2, "heun3", F32, note="four row chunks, long k-segments"),
    case("cluster", 1, 1, (), 3, "midpoint", F32, note="one Linear layer: X read and pushed in one layer"),
    case("split", 3, 64, (256, 256), 2, "rk4", F32, note="the seed field, 4 blocks per row, four stages"),
    case("split", 40, 64, (256, 256), 2, "heun3", F32, note="2 blocks per row on 132 SMs (4B > SMs)"),
    case("general", 300, 2, (64, 64, 64), 2, "euler", F32, note="forced where shared applies"),
    case(NATURAL, 0, 2, (8,), 2, "euler", F32, note="empty batch"),
]

ODE_BACKWARD_CASES = [
    case("stepwise", 300, 2, (64, 64, 64), 3, "midpoint", F32, note="several column tiles"),
    case("stepwise", 5, 3, (7,), 2, "rk4", F64, note="float64, four stages"),
    case(NATURAL, 0, 2, (8,), 2, "euler", F32, note="empty batch: zero weight gradients"),
]

# vae_mlp_elbo: (B, I, encoder widths, L, decoder widths, dtype).
VAE_MLP_CASES = [
    case("cluster", 17, 101, (33, 17), 5, (17, 33), F32, note="odd widths, scalar reads, a partial row tile"),
    case("cluster", 128, 784, (512, 256), 64, (256, 512), F32, note="the benchmark's model, float4 reads"),
    case("cluster", 5, 6, (5, 4, 3, 2), 2, (2, 3, 4, 5), F32, note="depth 4, slices smaller than the cluster"),
    case("cublas", 130, 20, (17, 9), 4, (9, 17), F32, note="odd widths, a partial warp of rows"),
    case("cublas", 33, 784, (512, 256), 64, (256, 512), F32, note="the benchmark's Gaussian model"),
    case("cublas", 5, 6, (5, 4, 3, 2), 2, (2, 3, 4, 5), F64, note="four hidden layers each side, float64"),
    case(NATURAL, 0, 6, (5,), 2, (5,), F32, note="empty batch"),
]

VAE_MLP_BACKWARD_CASES = [
    case("cublas", 130, 20, (17, 9), 4, (9, 17), F32, note="odd widths"),
    case("cublas", 5, 6, (5, 4, 3, 2), 2, (2, 3, 4, 5), F64, note="depth 4, float64"),
    case(NATURAL, 0, 6, (5,), 2, (5,), F32, note="empty batch: zero weight gradients"),
]


def _ilw_inputs(b, n, d, k, kq, dtype):
    opts = dict(device="cuda", dtype=dtype)
    return (torch.randn(b, n, d, **opts) * 2, torch.rand(b, k, **opts) + 0.2, torch.randn(b, k, d, **opts) * 1.5,
            torch.rand(b, k, d, **opts) + 0.6, torch.rand(b, kq, **opts) + 0.2, torch.randn(b, kq, d, **opts) * 0.5,
            torch.rand(b, kq, d, **opts) + 1.5)


def run_ilw(b, n, d, k, kq, dtype):
    """importance_log_weights [b, n] against the reference in float64."""
    args = _ilw_inputs(b, n, d, k, kq, dtype)
    got = fused_ops.importance_log_weights(*args)
    want = reference.importance_log_weights(*(a.double() for a in args))
    return close([got.double()], [want], atol=1e-4 * max(want.abs().max().item(), 1.0))


def run_ilw_backward(b, n, d, k, kq, dtype):
    """The gradients of all seven inputs against the reference's autograd in float64."""
    args = [a.requires_grad_() for a in _ilw_inputs(b, n, d, k, kq, dtype)]
    up = torch.randn(b, n, device="cuda", dtype=dtype) / n**0.5
    got = torch.autograd.grad(fused_ops.importance_log_weights(*args), args, up)
    args64 = [a.detach().double().requires_grad_() for a in args]
    want = torch.autograd.grad(reference.importance_log_weights(*args64), args64, up.double())
    return all(torch.allclose(g.double(), w, rtol=1e-3, atol=1e-4 * max(w.abs().max().item(), 1.0))
               for g, w in zip(got, want))


ILW_CASES = [  # sizes: (B, N, D, K, Kq, dtype)
    case("staged", 64, 300, 16, 3, 1, F32, note="many problems, a ragged last block"),
    case("staged", 1, 5000, 3, 2, 2, F64, note="one problem over many blocks, float64"),
    case("staged", 1, 1, 1, 1, 1, F32, note="smallest"),
    case("global", 2, 300, 1024, 3, 3, F32, note="parameters over 48 KB"),
    case("global", 3, 257, 5, 3, 2, F32, note="forced where staged applies"),
]

ILW_BACKWARD_CASES = [  # one path ("tiled")
    case(NATURAL, 64, 300, 16, 3, 1, F32, note="256-row coefficient tiles in shared memory"),
    case(NATURAL, 2, 500, 4, 30, 10, F32, note="J = 40: fewer rows per tile"),
    case(NATURAL, 2, 100, 2, 100, 60, F32, note="J = 160: the tile in global memory"),
    case(NATURAL, 1, 300, 700, 3, 2, F64, note="parameters in global memory, float64"),
    case(NATURAL, 1, 1, 1, 1, 1, F32, note="smallest"),
]

def _mm_operand(rows, cols, transposed):
    """A [rows, cols] float32 matrix, row-major or the transposed view of a [cols, rows] one."""
    if transposed:
        return torch.randn(cols, rows, device="cuda").t()
    return torch.randn(rows, cols, device="cuda")


def run_matmul(m, n, k, ta, tb, act=None):
    """The products under the kernels (``torch.ops.fused_ops._matmul``) against a float64 product;
    with ``act``, a hidden layer (``_linear_act``: a @ w^T, the bias, a row bias and the activation
    in the product's epilogue)."""
    if act is None:
        a, b = _mm_operand(m, k, ta), _mm_operand(k, n, tb)
        got = torch.ops.fused_ops._matmul(a, b)
        return close([got.double()], [a.double() @ b.double()], atol=1e-5 * k**0.5, rtol=0)
    from fused_ops.ops import _ode

    code, p = _ode._act(act, None)
    a, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    bias, row_bias = torch.randn(n, device="cuda"), torch.randn(m, n, device="cuda")
    out, h = torch.ops.fused_ops._linear_act(a, w, bias, row_bias, code, p, False)
    exact = a.double() @ w.double().t() + bias.double() + row_bias.double()
    return close([out.double(), h.double()], [exact, _ode._TORCH_ACTS[act](out, p).double()],
                 atol=1e-5 * k**0.5, rtol=1e-5)


MATMUL_CASES = [  # sizes: (m, n, k, a transposed, b transposed); float32 only (the table's dtype).
    # The tf32x3 path reads a transposed view along its rows: m a multiple of 4 there.
    case("tf32x3", 132, 200, 72, False, False, note="ragged tiles, row-major"),
    case("tf32x3", 132, 200, 72, True, False, note="a as a transposed view"),
    case("tf32x3", 132, 200, 72, False, True, note="b as a transposed view"),
    case("tf32x3", 132, 200, 72, True, True, note="both transposed"),
    case("tf32x3", 68, 132, 2048, True, False, note="split-K: 2 tiles over 16 slices, the weight-gradient layout"),
    case("cublas", 5, 7, 3, False, False, note="below the tensor-core sizes"),
    case("tf32x3", 132, 200, 72, False, False, "gelu", note="epilogue: bias, row bias, GELU, ragged tiles"),
    case("tf32x3", 128, 128, 4096, False, False, "silu", note="epilogue in the split-K add"),
    case("cublas", 5, 7, 3, False, False, "elu", note="epilogue pass after a cuBLAS product"),
]

# op -> (runner, cases); the runner's forced path is the op's own table's.
OPS = {
    "importance_sampling": (run_is, IS_CASES),
    "importance_sampling_backward": (run_is_backward, IS_BACKWARD_CASES),
    "flow_euler": (run_flow, FLOW_CASES),
    "flow_euler_backward": (run_flow_backward, FLOW_BACKWARD_CASES),
    "vae_elbo": (run_vae, VAE_CASES),
    "vae_elbo_backward": (run_vae_backward, VAE_BACKWARD_CASES),
    "vae_elbo_train": (run_vae_train, VAE_TRAIN_CASES),
    "vae_elbo_train_backward": (run_vae_train_backward, VAE_TRAIN_BACKWARD_CASES),
    "snis": (run_snis, SNIS_CASES),
    "snis_backward": (run_snis_backward, SNIS_BACKWARD_CASES),
    "resample": (run_resample, RESAMPLE_CASES),
    "ode_mlp": (run_ode, ODE_CASES),
    "ode_mlp_backward": (run_ode_backward, ODE_BACKWARD_CASES),
    "vae_mlp_elbo": (run_vae_mlp, VAE_MLP_CASES),
    "vae_mlp_elbo_backward": (run_vae_mlp_backward, VAE_MLP_BACKWARD_CASES),
    "importance_log_weights": (run_ilw, ILW_CASES),
    "importance_log_weights_backward": (run_ilw_backward, ILW_BACKWARD_CASES),
    "matmul": (run_matmul, MATMUL_CASES),
}
ALIASES = {"flow": ["flow_euler", "flow_euler_backward"],
           "vae": ["vae_elbo", "vae_elbo_backward", "vae_elbo_train", "vae_elbo_train_backward"],
           "ode": ["ode_mlp", "ode_mlp_backward"], "vae_mlp": ["vae_mlp_elbo", "vae_mlp_elbo_backward"],
           "ilw": ["importance_log_weights", "importance_log_weights_backward"],
           "flow_backward": ["flow_euler_backward"], "vae_backward": ["vae_elbo_backward", "vae_elbo_train_backward"]}


# ----------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------


class NotApplicable(Exception):
    """The forced path's condition does not hold for this case."""


def table_paths(op: str) -> list:
    """The op's CUDA paths in this build, or [] without a table."""
    if _paths is None or (op, "cuda") not in _paths.tables():
        return []
    return _paths.names(op)


def run_one(op: str, runner: Callable, c: Case, path) -> Tuple[bool, str]:
    """Runs one case, forced to ``path`` (None: unforced); returns (matched, path taken)."""
    torch.manual_seed(0)
    try:
        with _paths.force(op, path) if path is not None else contextlib.nullcontext():
            ok = bool(runner(*c.size))
            torch.cuda.synchronize()
    except RuntimeError as exc:
        if path is not None and "does not apply to this call" in str(exc):
            raise NotApplicable(str(exc).splitlines()[0]) from exc
        raise
    taken = _paths.last(op) if table_paths(op) else "-"
    return ok, taken


def describe(op: str, c: Case) -> str:
    size = " ".join(str(v).replace("torch.", "") for v in c.size)
    return f"{op} ({size})" + (f" [{c.note}]" if c.note else "")


def run_op(op: str) -> Tuple[int, list]:
    """Every path of ``op``; returns (mismatches, paths that ran on no case)."""
    runner, cases = OPS[op]
    paths = table_paths(op)
    failures = 0
    ran = set()

    def attempt(c: Case, path) -> bool:
        nonlocal failures
        try:
            ok, taken = run_one(op, runner, c, path)
        except NotApplicable:
            print(f"  skip      {describe(op, c)}: path '{path}' does not apply on this device or build")
            return False
        ran.add(taken)
        failures += not ok
        print(f"  {'ok' if ok else 'MISMATCH':<9} {describe(op, c)}: path {taken}"
              + ("" if path is None or taken == path else f" (forced {path})"), flush=True)
        return True

    print(f"{op}: paths {', '.join(paths) if paths else '(no table: unforced)'}", flush=True)
    for c in cases:
        if not paths or c.paths == (NATURAL,):
            attempt(c, None)
        for path in c.paths:
            if paths and path != NATURAL and path in paths:
                attempt(c, path)
            elif paths and path != NATURAL:
                print(f"  note      {describe(op, c)}: this build has no path '{path}'")
    for path in paths:
        if path in ran:
            continue
        for c in sorted(cases, key=Case.cost):  # no case named it, or none applied: find one
            if attempt(c, path):
                break
    missing = [p for p in paths if p not in ran]
    return failures, missing


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ops", nargs="*", help=f"ops to run (default: all): {', '.join(OPS)}")
    parser.add_argument("--list", action="store_true", help="print the cases and this build's paths, run nothing")
    args = parser.parse_args(argv)
    names = []
    for name in args.ops or list(OPS):
        names += ALIASES.get(name, [name])
    unknown = [n for n in names if n not in OPS]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {list(OPS)}")
    if args.list:
        for op in names:
            print(f"{op}: paths of this build: {table_paths(op) or '(no table)'}")
            for c in OPS[op][1]:
                print(f"  {'/'.join(c.paths):<10} {describe(op, c)}")
        return 0
    if not torch.cuda.is_available():
        print("sanitize_run needs a CUDA device", file=sys.stderr)
        return 2
    failures, missing = 0, []
    for op in names:
        f, m = run_op(op)
        failures += f
        missing += [f"{op}/{p}" for p in m]
    print(f"summary: {failures} mismatches; paths not run: {', '.join(missing) if missing else 'none'}")
    return 1 if failures or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
