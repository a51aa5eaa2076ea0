"""Checks of fused_ops across processes, for any torch.distributed backend
and device: each fused module trained under DistributedDataParallel and
FSDP2 (``fully_shard``) against the reference module it replaces, and
:func:`fused_ops.distributed.snis` on shards of one sample set against
:func:`fused_ops.snis` on the concatenation.  Called by tools/multi_gpu.py on
every rank of a running process group (NCCL on GPUs, gloo on the CPU) and,
through it, by the CI tests (tests/test_distributed_modules.py,
tests/test_distributed_snis.py).  Each check raises AssertionError naming what
disagreed.

Training.  Every rank builds the same model (the reference, and a fused copy
with the same parameters), draws the same global batch of ``world * per_rank``
samples and trains on its slice; the loss is a mean over the samples of its
slice, so DDP's and FSDP2's gradient averaging gives the gradient of the mean
over the global batch, which a single process computes from the whole batch.
Plain SGD (an update linear in the gradient, so float32 rounding differences
stay of their own size over the steps).  Compared after ``steps`` steps:
every step's global loss (the mean of the ranks' losses) and every parameter,
of the fused module under DDP/FSDP2 against the reference under the same
wrapper, and against the fused module trained in one process on the global
batch.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

import fused_ops
import fused_ops.distributed as fd
from fused_ops import nn as fnn
from fused_ops import reference
from fused_ops.ops import odeint_fixed

F32_TOL = dict(rtol=2e-5, atol=2e-6)  # float32: the same sums rounded in another order
F64_TOL = dict(rtol=1e-10, atol=1e-12)
# Training comparisons (losses, parameters after the steps).  On CUDA the
# fused kernels' path depends on the batch size (a rank's slice and the global
# batch may take different ones) and the reference's cuBLAS products reduce in
# their own order: there the contract's float32 tolerance of fused against
# reference (rtol 1e-4), with an absolute floor well under the parameters'
# movement (0.05 to 0.13 over the steps).
TRAIN_TOL = {"cpu": F32_TOL, "cuda": dict(rtol=1e-4, atol=1e-5)}


# -- the models: (reference module, its fused copy, batch maker, loss) ----------


class LearnedProposal(nn.Module):
    """Importance sampling with a learned location-scale proposal: samples
    ``loc + exp(log_scale) * eps`` (``eps [B, N, D]``, B independent
    problems) weighted by ``sampler`` (an ImportanceSampler, reference or
    fused: a function of the samples), loss per problem ``|mean|^2 - log(ess)``."""

    def __init__(self, dim):
        super().__init__()
        self.loc = nn.Parameter(torch.full((dim,), 0.5))
        self.log_scale = nn.Parameter(torch.full((dim,), 0.3))
        self.sampler = reference.ImportanceSampler(dim)

    def forward(self, eps):
        x = self.loc + self.log_scale.exp() * eps
        losses = []
        for xb in x.unbind(0):  # ImportanceSampler takes one problem [N, D]
            mean, ess = self.sampler(xb)
            losses.append(mean.square().sum() - ess.log())
        return torch.stack(losses)


class LearnedSNIS(nn.Module):
    """SNIS of a unit Gaussian target at ``target`` with the learned proposal
    ``Normal(loc, exp(log_scale))``: per problem (``eps [B, N, D]``) the loss
    ``-log_evidence + |mean - target|^2 + sum(variance)`` from ``snis``
    (a reference or fused SNIS module)."""

    def __init__(self, dim):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(dim))
        self.log_scale = nn.Parameter(torch.full((dim,), 0.5))
        self.register_buffer("target", torch.linspace(-1.0, 1.0, dim))
        self.snis = reference.SNIS(moments=True)

    def forward(self, eps):
        scale = self.log_scale.exp()
        x = self.loc + scale * eps
        log_q = (-0.5 * eps.square() - self.log_scale).sum(-1)
        log_p = (-0.5 * (x - self.target).square()).sum(-1)
        _, _, log_z, mean, var = self.snis(log_p - log_q, x)
        return -log_z + (mean - self.target).square().sum(-1) + var.sum(-1)


class ReferenceODE(nn.Module):
    """``velocity`` integrated over ``[0, 1]`` with torchdiffeq's fixed-grid
    ``method`` in plain PyTorch (:func:`fused_ops.ops.odeint_fixed`), time as
    the last input feature: what ``fused_ops.nn.ODESampler`` replaces."""

    def __init__(self, velocity, method, num_steps):
        super().__init__()
        self.velocity, self.method, self.num_steps = velocity, method, num_steps

    def forward(self, x0):
        t = torch.linspace(0.0, 1.0, self.num_steps + 1, dtype=x0.dtype, device=x0.device)

        def f(s, y):
            return self.velocity(torch.cat([y, s.expand(y.shape[0], 1)], -1))

        return odeint_fixed(f, x0, t, self.method)[-1]


def _to_fused_submodule(name, convert):
    def to_fused(model):
        setattr(model, name, convert(getattr(model, name)))
        return model
    return to_fused


def _vae_batch(g, n, dims):
    i, _, l_ = dims
    return torch.rand(n, i, generator=g), torch.randn(n, l_, generator=g)


def _ode_batch(g, n, d):
    return torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)


def _squared_error(out, target):
    return (out - target).square().sum(-1)


MODELS = {
    # name: (reference maker, reference -> fused (in place, on a copy), batch maker (generator, n), per-sample loss)
    "VAE": (lambda: reference.VAE(24, 16, 4), fnn.convert,
            lambda g, n: _vae_batch(g, n, (24, 16, 4)), lambda m, x, eps: -m(x, eps)[0]),
    "FlowODE": (lambda: reference.FlowODE(3, 4), fnn.convert,
                lambda g, n: _ode_batch(g, n, 3), lambda m, x0, y: _squared_error(m(x0), y)),
    "ODESampler": (lambda: ReferenceODE(nn.Sequential(nn.Linear(3, 16), nn.SiLU(), nn.Linear(16, 16), nn.SiLU(),
                                                      nn.Linear(16, 2)), "midpoint", 4),
                   lambda m: fnn.ODESampler(m.velocity, method=m.method, num_steps=m.num_steps),
                   lambda g, n: _ode_batch(g, n, 2), lambda m, x0, y: _squared_error(m(x0), y)),
    "ImportanceSampler": (lambda: LearnedProposal(2), _to_fused_submodule("sampler", fnn.convert),
                          lambda g, n: (torch.randn(n, 64, 2, generator=g),), lambda m, eps: m(eps)),
    "SNIS": (lambda: LearnedSNIS(3), _to_fused_submodule("snis", fnn.SNIS.from_reference),
             lambda g, n: (torch.randn(n, 128, 3, generator=g),), lambda m, eps: m(eps)),
}


# -- training runs -----------------------------------------------------------------


def _full(p):
    """A parameter's full value (an FSDP2 DTensor gathered), detached."""
    p = p.detach()
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def train(model, batches, loss_fn, steps, lr, *, distributed):
    """``steps`` SGD steps of ``mean(loss_fn(model, *batch))`` on ``batches``
    (this rank's); returns (the global loss of each step, the parameters by
    name).  With ``distributed`` the step's loss is averaged over the ranks."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model, *batches).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if distributed:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses, {_unwrapped_name(n): _full(p).cpu() for n, p in model.named_parameters()}


def _unwrapped_name(name):
    """A parameter's name in the module itself, without torch.compile's and DDP's prefixes."""
    for prefix in ("_orig_mod.", "module."):
        name = name.removeprefix(prefix)
    return name


def _wrap(model, how, device, compile_backend):
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        # The mesh on the model's device (the default would be the accelerator's, also for a CPU run on a GPU host).
        fully_shard(model, mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
    if compile_backend:
        model = torch.compile(model, backend=compile_backend)
    return model


def _assert_run_close(what, got, want, tol):
    torch.testing.assert_close(torch.tensor(got[0], dtype=torch.float64), torch.tensor(want[0], dtype=torch.float64),
                               **tol, msg=lambda m: f"{what}: losses per step {got[0]} vs {want[0]}: {m}")
    assert got[1].keys() == want[1].keys(), f"{what}: parameter names {sorted(got[1])} vs {sorted(want[1])}"
    for name, p in got[1].items():
        torch.testing.assert_close(p, want[1][name], **tol, msg=lambda m, name=name: f"{what}: {name}: {m}")


def check_module(name, how, device, *, per_rank=4, steps=3, lr=0.05, compile_backend=None, seed=0):
    """The fused module ``name`` (of MODELS) wrapped by ``how`` ("ddp" or
    "fsdp2"; optionally compiled) trained on this rank's slice of the global
    batch: its losses and parameters equal the reference module's under the
    same wrapper and the fused module's in one process on the global batch,
    in float32.  Returns a dict of the largest differences."""
    device = torch.device(device)
    make_ref, to_fused, make_batch, loss_fn = MODELS[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    ref = make_ref()
    fused = to_fused(copy.deepcopy(ref))
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    g = torch.Generator().manual_seed(seed + 1)
    batch = [t.to(device) for t in make_batch(g, world * per_rank)]
    mine = [t[rank * per_rank:(rank + 1) * per_rank] for t in batch]

    single = train(copy.deepcopy(fused).to(device), batch, loss_fn, steps, lr, distributed=False)
    runs = {}
    for label, model in (("reference", ref), ("fused", fused)):
        wrapped = _wrap(copy.deepcopy(model).to(device), how, device, compile_backend)
        runs[label] = train(wrapped, mine, loss_fn, steps, lr, distributed=True)
    what = f"{name} under {how}" + (f" compiled ({compile_backend})" if compile_backend else "")
    tol = TRAIN_TOL[device.type]
    _assert_run_close(f"{what}: fused vs reference", runs["fused"], runs["reference"], tol)
    _assert_run_close(f"{what}: fused vs one process on the global batch", runs["fused"], single, tol)
    moved = max((p - initial[n]).abs().max().item() for n, p in runs["fused"][1].items())
    assert moved > 0, f"{what}: the parameters did not move"
    return {
        "loss": runs["fused"][0][-1],
        "max_param_change": moved,
        "max_param_diff_vs_reference": max((p - runs["reference"][1][n]).abs().max().item()
                                           for n, p in runs["fused"][1].items()),
        "max_param_diff_vs_single": max((p - single[1][n]).abs().max().item() for n, p in runs["fused"][1].items()),
    }


# -- distributed SNIS --------------------------------------------------------------

SNIS_OUT = ("log_norm_weights", "ess", "log_evidence", "mean", "variance")


def _snis_problem(sizes, batch, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    lw = (torch.randn(*batch, n, generator=g, dtype=torch.float64) * 3).to(dtype)
    x = (torch.randn(*batch, n, d, generator=g, dtype=torch.float64) + 1).to(dtype)
    ups = [torch.randn(*batch, n, generator=g, dtype=torch.float64).to(dtype)] + [
        torch.randn(tuple(s), generator=g, dtype=torch.float64).to(dtype)
        for s in (batch, batch, (*batch, d), (*batch, d))]
    return lw, x, ups


def _snis_loss(outs, ups, lnw_up):
    # The shard term uses this rank's slice; the replicated terms are the same on every rank.
    return (outs[0] * lnw_up).sum() + sum((o * u).sum() for o, u in zip(outs[1:], ups[1:]))


def check_snis(sizes, batch, d, moments, with_samples, dtype, device="cpu", seed=0):
    """``fused_ops.distributed.snis`` on this rank's shard (``sizes[rank]``
    of the ``sum(sizes)`` samples, in rank order) against ``fused_ops.snis``
    on the concatenation in this process (the same problem on every rank,
    drawn from ``seed``): values and gradients of a loss of every output; a
    second call gives the same bits; every rank holds the same replicated
    outputs.  Returns the largest difference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert len(sizes) == world, f"{len(sizes)} shard sizes for {world} ranks"
    lw, x, ups = (t.to(device) if torch.is_tensor(t) else [u.to(device) for u in t]
                  for t in _snis_problem(sizes, batch, d, dtype, seed=seed + len(sizes) * 100 + d))
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    n_out = 5 if moments else (4 if with_samples else 3)

    lw1 = lw.clone().requires_grad_()
    x1 = x.clone().requires_grad_() if with_samples else None
    want = fused_ops.snis(lw1, x1, moments)
    g_want = torch.autograd.grad(_snis_loss(want[:n_out], ups, ups[0]), [lw1] + ([x1] if with_samples else []))

    lws = lw[..., lo:hi].clone().requires_grad_()
    xs = x[..., lo:hi, :].clone().requires_grad_() if with_samples else None
    got = fd.snis(lws, xs, moments=moments)
    g_got = torch.autograd.grad(_snis_loss(got[:n_out], ups, ups[0][..., lo:hi]),
                                [lws] + ([xs] if with_samples else []))

    # Every collective before the first assert: a rank that fails leaves the others in step.
    again = fd.snis(lws.detach(), None if xs is None else xs.detach(), moments=moments)
    gathered = []
    for k in range(1, n_out):
        gathered.append([torch.empty_like(got[k]) for _ in range(world)])
        dist.all_gather(gathered[-1], got[k].detach().contiguous())

    tol = F64_TOL if dtype == torch.float64 else F32_TOL
    worst = 0.0

    def close(a, b, what):
        nonlocal worst
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"snis {sizes} batch {batch} D={d}: {what}: {m}")
        if a.numel():
            worst = max(worst, (a.double() - b.double()).abs().max().item())

    close(got[0], want[0][..., lo:hi].detach(), SNIS_OUT[0])
    for k in range(1, n_out):
        close(got[k], want[k].detach(), SNIS_OUT[k])
    for k in range(n_out, 5):
        assert got[k].shape == (0,), f"{SNIS_OUT[k]} not asked for: shape {tuple(got[k].shape)}, want (0,)"
    close(g_got[0], g_want[0][..., lo:hi], "gradient of the log weights")
    if with_samples:
        close(g_got[1], g_want[1][..., lo:hi, :], "gradient of the samples")
    for k, (a, b) in enumerate(zip(got, again)):
        assert torch.equal(a.detach(), b), f"{SNIS_OUT[k]}: a second call differs"
    for k, parts in zip(range(1, n_out), gathered):
        assert all(torch.equal(t, parts[0]) for t in parts), f"{SNIS_OUT[k]} differs between ranks"
    return worst


def snis_cases(world, n=5700):
    """The shard layouts every run checks: uneven shards (rank r holds about
    ``(r + 1)**2`` parts of ``n``), and the same with rank ``(world - 1) // 2``
    (rank 0 of two) holding no samples, each over four call forms: (shard sizes, batch
    shape, D, moments, with samples, dtype)."""
    uneven = [n * (r + 1) ** 2 // sum((k + 1) ** 2 for k in range(world)) + r for r in range(world)]
    empty = [0 if r == (world - 1) // 2 else s for r, s in enumerate(uneven)]
    f64, f32 = torch.float64, torch.float32
    forms = [((), 3, True, True, f64), ((2, 3), 2, False, True, f64), ((4,), 1, False, False, f64),
             ((2,), 4, True, True, f32)]
    return [(sizes, *form) for sizes in (uneven, empty) for form in forms]


__all__ = ["MODELS", "check_module", "check_snis", "snis_cases", "train", "LearnedProposal", "LearnedSNIS",
           "ReferenceODE"]
