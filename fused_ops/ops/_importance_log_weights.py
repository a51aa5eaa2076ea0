"""``fused_ops.importance_log_weights``: the unnormalised importance log
weights ``log p(x) - log q(x)`` of many independent problems, target and
proposal diagonal Gaussian mixtures.

The function, its fused backward, their fake (meta) implementations and the
autograd registration.  The kernels are registered from C++
(``csrc/cuda/importance_log_weights/``, ``csrc/cpu/importance_log_weights/``).
:func:`fused_ops.importance_sampling` calls this op, then ``snis``, for its
batched, mixture-proposal and evidence calls.
"""

import math

import torch
from torch import Tensor

from .. import _eager
from . import _dtypes
from ._checks import check, check_rank, check_same_float_dtype_and_device, check_size, shape_str

__all__ = ["importance_log_weights", "importance_log_weights_backward", "flatten_problems"]

_OP = torch.ops.fused_ops.importance_log_weights.default
_BACKWARD_OP = torch.ops.fused_ops.importance_log_weights_backward.default

_ARG_NAMES = ("samples", "mix_weights", "mix_mus", "mix_stds", "q_weights", "q_mus", "q_stds")
# Each argument's own (trailing) dimensions; the ones before them are batch dimensions.
_TAILS = {"samples": "[N, D]", "mix_weights": "[K]", "mix_mus": "[K, D]", "mix_stds": "[K, D]",
          "q_weights": "[Kq]", "q_mus": "[Kq, D]", "q_stds": "[Kq, D]"}


def importance_log_weights(
    samples: Tensor,
    mix_weights: Tensor,
    mix_mus: Tensor,
    mix_stds: Tensor,
    q_weights: Tensor,
    q_mus: Tensor,
    q_stds: Tensor,
) -> Tensor:
    r"""Unnormalised importance log weights ``log p(x) - log q(x)``, target ``p``
    and proposal ``q`` both mixtures of diagonal Gaussians, for many
    independent problems in one fused kernel.

    Shapes: ``samples [..., N, D]``; target ``mix_weights [..., K]``,
    ``mix_mus [..., K, D]``, ``mix_stds [..., K, D]``; proposal
    ``q_weights [..., Kq]``, ``q_mus [..., Kq, D]``, ``q_stds [..., Kq, D]``
    (a Gaussian proposal: ``Kq = 1``, weight 1).  The leading dimensions are
    independent problems and must equal samples' (:func:`fused_ops.importance_sampling`
    broadcasts); ``N, K, Kq >= 1``.
    All float32 or all float64 on one device (bfloat16/float16 and autocast:
    as :func:`fused_ops.importance_sampling`).

    Math, per problem (the :math:`-\tfrac{D}{2}\log 2\pi` terms cancel and are omitted)::

        log_mix(x; w, mu, std) = logsumexp_k( log w[k] + sum_d( -0.5*((x[d]-mu[k,d])/std[k,d])**2 - log std[k,d] ) )
        log_weights[i] = log_mix(x[i]; mix_weights, mix_mus, mix_stds) - log_mix(x[i]; q_weights, q_mus, q_stds)

    Returns ``log_weights [..., N]`` (``...``: the broadcast batch shape).
    The weights need not sum to 1 (``log w`` is used as given).  The batch
    dimensions are flattened into one (a view of contiguous arguments);
    expanded (stride-0) arguments are copied by the op.

    Numerics: CPU in double, rounded once; CUDA in the inputs' dtype (two
    interleaved partial sums per squared distance, an online log-sum-exp
    over the components).  A sample where every target (or proposal)
    component density is zero gets ``-inf`` (``+inf``); NaN propagates.
    Bitwise reproducible on one device.

    Differentiable in every input through the fused
    :func:`importance_log_weights_backward` op (responsibilities
    recomputed, nothing but the inputs saved); double backward and
    forward-mode AD are not supported.
    """
    args, out_dtype = _dtypes.to_compute_dtype(
        _ARG_NAMES, (samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds))
    flat, batch = flatten_problems(args)
    lw = _eager.call(_OP, flat)
    return _dtypes.from_compute_dtype(lw.reshape(*batch, lw.shape[-1]), out_dtype)


def flatten_problems(args, broadcast=False, names=_ARG_NAMES):
    """The seven arguments of :func:`importance_log_weights` with leading
    dimensions checked and flattened to one batch dimension ``B``:
    ``(args [B, ...], batch shape)``.  Each argument's own dimensions are
    checked first, naming it, counted from the end.  Leading dimensions must
    equal samples' (a view, no copy, for contiguous arguments), or with
    ``broadcast`` broadcast against each other (then expanded and copied).
    ``names``: the arguments' names in the caller's signature (errors name them)."""
    layouts = dict(zip(names, _TAILS.values()))
    tails = [layouts[name].count(",") + 1 for name in names]
    _check_own_dims(args, names, layouts, tails)
    leads = [tuple(t.shape[:t.dim() - rank]) for t, rank in zip(args, tails)]
    if broadcast:
        batch = ()
        for i, (lead, name) in enumerate(zip(leads, names)):
            try:
                batch = torch.broadcast_shapes(batch, lead)
            except RuntimeError:
                other = next(j for j in range(i) if not _broadcastable(leads[j], lead))
                raise RuntimeError(
                    f"{name}'s batch dimensions {list(lead)} do not broadcast with {names[other]}'s "
                    f"{list(leads[other])}: leading dimensions are independent problems") from None
        args = [t.expand(*batch, *t.shape[t.dim() - rank:]) for t, rank in zip(args, tails)]
    else:
        batch = leads[0]
        for t, name, lead, rank in zip(args[1:], names[1:], leads[1:], tails[1:]):
            _need(len(lead) == len(batch), lambda: (
                f"{name} must be a {len(batch) + rank}-D tensor [..., {layouts[name][1:]} (the batch dimensions "
                f"of samples, then its own), got shape {shape_str(t)}"))
            for i, size in enumerate(batch):
                _need_size(t, name, i, size, "a batch dimension of samples")
    b = math.prod(batch)
    flat = tuple(t.reshape(b, *t.shape[t.dim() - rank:]) for t, rank in zip(args, tails))
    return flat, tuple(batch)


def _check_own_dims(args, names, layouts, tails):
    """Each argument's rank and its own (trailing) sizes, naming it."""
    for t, name, rank in zip(args, names, tails):
        what = f"{name} must be a {rank}-D tensor {layouts[name]} or batched [..., {layouts[name][1:]}"
        if t is None:
            raise RuntimeError(f"{what}, got None")
        _need(t.dim() >= rank, lambda: f"{what}, got shape {shape_str(t)}")
    d = args[0].shape[-1]
    k, kq = args[1].shape[-1], args[4].shape[-1]
    kname = "K, the number of mixture components in mix_weights"
    kqname = "Kq, the number of proposal components in q_weights"
    for i, size, dim_name in ((2, k, kname), (3, k, kname), (5, kq, kqname), (6, kq, kqname)):
        _need_size(args[i], names[i], -2, size, dim_name)
        _need_size(args[i], names[i], -1, d, "D, the sample dimension of samples")


def _need(cond, message):
    """_checks.check with the message built only on failure: the checks above
    run in the traced function under torch.compile, where formatting a
    symbolic size cannot be traced (a symbolic condition becomes a guard)."""
    if isinstance(cond, bool):
        if not cond:
            raise RuntimeError(message())
        return
    torch._check(cond)


def _need_size(t, name, dim, expected, what):
    _need(t.shape[dim] == expected, lambda: (
        f"{name}.shape[{dim}] must be {expected} ({what}), got shape {shape_str(t)}"))


def _broadcastable(a, b):
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(a), reversed(b)))


def _check_args(samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds):
    """The rules of csrc/importance_log_weights.h's check_importance_log_weights_args,
    in its order and with its messages; returns ``(B, N, D, K, Kq)``."""
    check_rank(samples, "samples", 3, "[B, N, D]")
    check_rank(mix_weights, "mix_weights", 2, "[B, K]")
    check_rank(mix_mus, "mix_mus", 3, "[B, K, D]")
    check_rank(mix_stds, "mix_stds", 3, "[B, K, D]")
    check_rank(q_weights, "q_weights", 2, "[B, Kq]")
    check_rank(q_mus, "q_mus", 3, "[B, Kq, D]")
    check_rank(q_stds, "q_stds", 3, "[B, Kq, D]")
    b, n, d = samples.shape
    k, kq = mix_weights.shape[1], q_weights.shape[1]
    check(n >= 1, "samples must hold at least one sample per problem (N >= 1): the self-normalised ",
          "weights are undefined for N = 0, got shape ", shape_str(samples))
    check(k >= 1, "mix_weights must hold at least one mixture component (K >= 1), got shape ", shape_str(mix_weights))
    check(kq >= 1, "q_weights must hold at least one proposal component (Kq >= 1), got shape ", shape_str(q_weights))
    batch, dim = "B, the number of problems in samples", "D, the sample dimension of samples"
    kname, kqname = "K, the number of mixture components in mix_weights", "Kq, the number of proposal components in q_weights"
    check_size(mix_weights, "mix_weights", 0, b, batch)
    for t, name, size, what in ((mix_mus, "mix_mus", k, kname), (mix_stds, "mix_stds", k, kname)):
        check_size(t, name, 0, b, batch)
        check_size(t, name, 1, size, what)
        check_size(t, name, 2, d, dim)
    check_size(q_weights, "q_weights", 0, b, batch)
    for t, name, size, what in ((q_mus, "q_mus", kq, kqname), (q_stds, "q_stds", kq, kqname)):
        check_size(t, name, 0, b, batch)
        check_size(t, name, 1, size, what)
        check_size(t, name, 2, d, dim)
    check_same_float_dtype_and_device([
        (samples, "samples"), (mix_weights, "mix_weights"), (mix_mus, "mix_mus"), (mix_stds, "mix_stds"),
        (q_weights, "q_weights"), (q_mus, "q_mus"), (q_stds, "q_stds"),
    ])
    return b, n, d, k, kq


@torch.library.register_fake("fused_ops::importance_log_weights")
def _importance_log_weights_fake(samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds):
    b, n, _, _, _ = _check_args(samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds)
    return samples.new_empty((b, n))


def importance_log_weights_backward(grad_log_weights, samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus,
                                    q_stds):
    r"""Fused backward of :func:`importance_log_weights` (what autograd calls),
    on the op's flat layout: ``grad_log_weights [B, N]`` (``None``: zero) and
    the seven inputs ``[B, ...]``; returns the gradients of the seven inputs,
    contiguous.

    Math, with ``g = grad_log_weights``, ``z[i,j,d] = (x[i,d]-mu[j,d])/std[j,d]``
    over the target's components and the proposal's, the responsibilities
    ``r[i,j]`` (softmax over the target's, and over the proposal's,
    component log densities; recomputed, not stored) and
    ``a[i,j] = g[i]*r[i,j]`` for the target, ``-g[i]*r[i,j]`` for the proposal::

        grad_samples[i,d] = -sum_j a[i,j]*z[i,j,d]/std[j,d]
        grad_mus[j,d]     =  sum_i a[i,j]*z[i,j,d]/std[j,d]
        grad_stds[j,d]    =  sum_i a[i,j]*(z[i,j,d]**2 - 1)/std[j,d]
        grad_weights[j]   =  sum_i a[i,j]/weights[j]

    Sums over samples run in double, as per-chunk (CPU) or per-block (CUDA)
    partials merged in a fixed order: bitwise reproducible.  Not
    differentiable itself.
    """
    return _eager.call(_BACKWARD_OP, (grad_log_weights, samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus,
                                      q_stds))


def _check_backward_args(grad_log_weights, samples, *params):
    """The rules of csrc/importance_log_weights.h's ImportanceLogWeightsBackwardCall."""
    b, n, _, _, _ = _check_args(samples, *params)
    if grad_log_weights is None:
        return
    check_rank(grad_log_weights, "grad_log_weights", 2, "[B, N]")
    check_size(grad_log_weights, "grad_log_weights", 0, b, "B, the number of problems in samples")
    check_size(grad_log_weights, "grad_log_weights", 1, n, "N, the number of samples per problem")
    check_same_float_dtype_and_device([(samples, "samples"), (grad_log_weights, "grad_log_weights")])


@torch.library.register_fake("fused_ops::importance_log_weights_backward")
def _importance_log_weights_backward_fake(grad_log_weights, samples, mix_weights, mix_mus, mix_stds, q_weights,
                                          q_mus, q_stds):
    params = (mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds)
    _check_backward_args(grad_log_weights, samples, *params)
    return tuple(t.new_empty(t.shape) for t in (samples, *params))  # contiguous, like the kernels' outputs


# Autograd: the fused backward op, itself not differentiable.


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # the inputs only: the backward recomputes the densities
    ctx.set_materialize_grads(False)  # the backward op takes None for no gradient


def _backward(ctx, grad_log_weights):
    return _eager.call(_BACKWARD_OP, (grad_log_weights, *ctx.saved_tensors))


_eager.forbid_double_backward(_BACKWARD_OP, "importance_log_weights", "fused_ops.reference.importance_log_weights")
_eager.register_autograd(_OP, _backward, _setup_context)
