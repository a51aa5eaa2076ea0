"""Self-normalised importance sampling across processes, on
``torch.distributed``: :func:`snis`.

Each rank holds a shard of the samples of the same problems.  One call
returns what :func:`fused_ops.snis` would return on the samples of all
ranks concatenated in rank order: the rank's shard of the normalised log
weights, and the global ESS, evidence and weighted moments (the same on
every rank).

How.  Each rank runs :func:`fused_ops.snis` on its shard; the shard's
outputs give its partial per problem: ``lse_r = logsumexp`` of its log
weights, ``q_r = sum w_local**2 = 1 / ess_r``, its size ``n_r``, its local
mean and variance.  One ``all_gather`` of these partials (``[..., 3 + 2 D]`` per rank,
whatever the shard size), then every rank combines them in rank order, in
float64::

    L = logsumexp_r(lse_r);  a_r = exp(lse_r - L)          # rank r's share of the weight
    log_norm_weights = local log_norm_weights + (lse_r - L)
    ess = 1 / sum_r a_r**2 q_r;  log_evidence = L - log(sum_r n_r)
    mean = sum_r a_r mean_r;  variance = sum_r a_r (var_r + (mean_r - mean)**2)

(the variance by Chan's pairwise update: no ``E[x^2] - mean^2``
cancellation).  An all_gather and a fixed-order combine rather than an
``all_reduce(MAX)`` + ``all_reduce(SUM)`` pair: one collective instead of
two, and bitwise the same result on every rank and every run for a fixed
world size (an all-reduce's summation order is the backend's).

Gradients equal the single-process gradients on the concatenated samples:
the backward makes one more ``all_gather`` (each rank's sum of the
upstream gradient of its log weights and its upstream gradients of the
replicated outputs), combined in rank order.  The replicated outputs'
upstream gradients are averaged over ranks, so a loss that every rank
computes identically from them (the usual SPMD loop) counts once, as in
the single process; the shard outputs' gradients add up over ranks.

A rank may hold no samples (``N = 0``): it contributes nothing.  All
ranks must call with the same batch shape, dtype, ``D`` and ``moments``.
"""

import math

import torch
import torch.distributed as dist

from .ops import snis as _local_snis

__all__ = ["snis"]


def _gather(t, group):
    world = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)  # [world, ...]: rank order


def _local_partials(lw, x, moments):
    """(lnw, [..., 3 + 2D] float64 partial: lse, q, n, mean, variance) of this rank's shard."""
    batch, n = lw.shape[:-1], lw.shape[-1]
    d = 0 if x is None else x.shape[-1]
    part = lw.new_zeros((*batch, 3 + 2 * d), dtype=torch.float64)
    part[..., 2] = n
    if n == 0:
        part[..., 0] = -math.inf
        return lw.new_empty(lw.shape), part
    lnw, ess, logz, mean, var = _local_snis(lw, x, moments)
    lse = logz.double() + math.log(n)
    part[..., 0] = lse
    # A shard of zero weights (all -inf) has NaN local moments: it carries no weight.
    zero = torch.isneginf(lse)
    part[..., 1] = torch.where(zero, 0.0, 1.0 / ess.double())
    if x is not None:
        part[..., 3:3 + d] = torch.where(zero[..., None], 0.0, mean.double())
        if moments:
            part[..., 3 + d:] = torch.where(zero[..., None], 0.0, var.double())
    return lnw, part


class _DistributedSnis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lw, x, moments, group):
        rank = dist.get_rank(group)
        d = 0 if x is None else x.shape[-1]
        with torch.no_grad():
            lnw_local, part = _local_partials(lw, x, moments)
            parts = _gather(part, group)  # [world, ..., 3 + 2D]
        lse = parts[..., 0]
        L = torch.logsumexp(lse, 0)
        # Rank r's share of the weight; a rank of zero weights has none, unless
        # every weight is zero (L = -inf): then NaN, as in the single process.
        a = torch.where(torch.isneginf(lse) & ~torch.isneginf(L), 0.0, torch.exp(lse - L))  # [world, ...]
        q = (a * a * parts[..., 1]).sum(0)
        ess = 1.0 / q
        logz = L - torch.log(parts[..., 2].sum(0))
        lnw = (lnw_local.double() + (lse[rank] - L)[..., None]).to(lw.dtype)
        empty = lw.new_empty(0)
        mean = var = empty
        mean64 = var64 = None
        if x is not None:
            mu_r = parts[..., 3:3 + d]
            mean64 = (a[..., None] * mu_r).sum(0)
            mean = mean64.to(lw.dtype)
            if moments:
                var64 = (a[..., None] * (parts[..., 3 + d:] + (mu_r - mean64) ** 2)).sum(0)
                var = var64.to(lw.dtype)
        ctx.group, ctx.moments, ctx.has_x = group, moments, x is not None
        ctx.save_for_backward(lnw, x, q, mean64 if mean64 is not None else empty,
                              var64 if var64 is not None else empty)
        ctx.set_materialize_grads(False)
        return lnw, ess.to(lw.dtype), logz.to(lw.dtype), mean, var

    @staticmethod
    def backward(ctx, g_lnw, g_ess, g_logz, g_mean, g_var):
        lnw, x, q, mean64, var64 = ctx.saved_tensors
        group = ctx.group
        world = dist.get_world_size(group)
        batch, d = q.shape, (x.shape[-1] if ctx.has_x else 0)
        f64 = dict(dtype=torch.float64, device=lnw.device)

        def flat(g, shape):
            return (torch.zeros(shape, **f64) if g is None else g.double().expand(shape)).reshape(*batch, -1)

        mine = torch.cat([
            flat(None if g_lnw is None else g_lnw.double().sum(-1), batch),
            flat(g_ess, batch), flat(g_logz, batch),
            flat(g_mean if ctx.has_x else None, (*batch, d)),
            flat(g_var if ctx.moments else None, (*batch, d)),
        ], -1)
        total = _gather(mine, group).sum(0)  # rank order
        sum_gl = total[..., 0]
        ge, gz = total[..., 1] / world, total[..., 2] / world
        gm, gv = total[..., 3:3 + d] / world, total[..., 3 + d:] / world
        w = lnw.double().exp()
        Q = q[..., None]
        g = -w * sum_gl[..., None] + ge[..., None] * 2 * w * (Q - w) / Q**2 + gz[..., None] * w
        if g_lnw is not None:
            g = g + g_lnw.double()
        grad_x = None
        if ctx.has_x:
            z = x.double() - mean64[..., None, :]
            term = (z * gm[..., None, :]).sum(-1)
            if ctx.moments:
                term = term + ((z * z - var64[..., None, :]) * gv[..., None, :]).sum(-1)
            g = g + w * term
            if ctx.needs_input_grad[1]:
                grad_x = (w[..., None] * (gm[..., None, :] + 2 * gv[..., None, :] * z)).to(x.dtype)
        return g.to(lnw.dtype), grad_x, None, None


def snis(log_weights_shard, samples_shard=None, *, group=None, moments=False):
    r"""Self-normalised importance sampling over the shards of all ranks.

    Shapes, on each rank: ``log_weights_shard [..., n_r]`` (``n_r >= 0``;
    the batch shape ``...`` the same on every rank), ``samples_shard
    [..., n_r, D]`` or ``None`` (on every rank alike); float32 or float64.
    ``group``: the process group (default: the world).

    Returns ``(log_norm_weights [..., n_r], ess [...], log_evidence [...],
    mean [..., D], variance [..., D])`` with the math of
    :func:`fused_ops.snis` over the concatenation of all shards in rank
    order (``N = sum_r n_r``): this rank's shard of the normalised log
    weights, and the global ESS, evidence, weighted mean and (with
    ``moments=True``) variance, identical on every rank.  ``mean`` without
    samples and ``variance`` without moments are empty ``[0]``.

    Collectives: one ``all_gather`` of ``[..., 3 + 2 D]`` float64 partials
    forward, one of the same size backward; deterministic for a fixed world size.  Differentiable
    in the log weights and samples; the replicated outputs' upstream
    gradients are averaged over ranks (a loss computed identically on every
    rank counts once), so gradients equal the single-process ones.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fused_ops.distributed.snis needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group); for one process use fused_ops.snis")
    if samples_shard is None and moments:
        raise RuntimeError("samples_shard must be given when moments=True (the variance is a moment of the "
                           "samples), got None")
    return _DistributedSnis.apply(log_weights_shard, samples_shard, bool(moments), group)
