"""``fused_ops.importance_sampling``: self-normalised importance sampling of a
Gaussian-mixture target with a diagonal Gaussian proposal.

The function, its fused backward, their fake (meta) implementations and the
autograd registration.  The kernels are registered from C++
(``csrc/cuda/importance_sampling/``, ``csrc/cpu/importance_sampling/``).
"""

import torch
from torch import Tensor

from .. import _eager
from . import _dtypes
from . import _snis  # noqa: F401  (registers snis' fake and autograd before the batched route uses it)
from ._checks import check, check_rank, check_same_float_dtype_and_device, check_size, shape_str
from ._importance_log_weights import flatten_problems

__all__ = ["importance_sampling", "importance_sampling_backward"]

_OP = torch.ops.fused_ops.importance_sampling.default
_BACKWARD_OP = torch.ops.fused_ops.importance_sampling_backward.default
_LW_OP = torch.ops.fused_ops.importance_log_weights.default
_SNIS_OP = torch.ops.fused_ops.snis.default


def importance_sampling(
    samples: Tensor,
    mix_weights: Tensor,
    mix_mus: Tensor,
    mix_stds: Tensor,
    q_mu: Tensor,
    q_std: Tensor,
    *,
    q_weights: Tensor | None = None,
    return_evidence: bool = False,
) -> tuple[Tensor, ...]:
    r"""Self-normalised importance sampling of a Gaussian-mixture target with a
    diagonal Gaussian (or Gaussian-mixture) proposal, in fused kernels.

    Shapes: ``samples [N, D]``, ``mix_weights [K]``, ``mix_mus [K, D]``,
    ``mix_stds [K, D]``, ``q_mu [D]``, ``q_std [D]``; all float32 or all
    float64, on one device (CPU or CUDA).  ``N >= 1``, ``K >= 1``.

    Dtypes: all float32 or all float64 (the kernels' rule, which
    ``torch.ops.fused_ops.*`` keeps); this function also takes all-bfloat16
    or all-float16 inputs, computes in float32 and returns its outputs in
    the inputs' dtype (gradients too).  Under ``torch.autocast`` (CPU, CUDA)
    lower-precision and float32 inputs run in float32 and the outputs are
    float32; float64 inputs stay float64 (``fused_ops/ops/_dtypes.py``).

    Math (the constant :math:`-\tfrac12\log 2\pi` terms cancel and are omitted)::

        log_p[i] = logsumexp_k( log w_k + sum_d( -0.5*((x[i,d]-mu[k,d])/std[k,d])**2 - log std[k,d] ) )
        log_q[i] = sum_d( -0.5*((x[i,d]-q_mu[d])/q_std[d])**2 - log q_std[d] )
        log_weights = (log_p - log_q) - logsumexp(log_p - log_q)       # over all N
        weighted_mean = sum_i exp(log_weights[i]) * x[i]              # [D]
        ess = 1 / sum_i exp(log_weights[i])**2                        # 0-d

    Returns ``(weighted_mean [D], ess [], log_weights [N])``.  ``log_weights``
    are normalised (``logsumexp == 0``), ready for resampling.  Results are
    bitwise reproducible for the same inputs on the same device.

    Non-finite log weights: a weight of ``-inf`` (zero) is ordinary; if a log
    weight is NaN or ``+inf``, or all of them are ``-inf`` (all mixture weights
    zero, an infinite weight or parameter, densities underflowing everywhere),
    there is no normaliser and every output is NaN, as the reference's mean
    and ESS are.  The normalised log weights are computed as
    ``(lw - max) - log(sum exp(lw - max))``, so log weights of huge magnitude
    keep their differences: ``N`` identical samples of ``1e10`` in float32 give
    exactly ``-log N``, the ESS ``N`` and the sample as the mean (the float32
    reference's own mean is off there; the op matches the exact answer).
    Subnormal stds, whose reciprocal overflows, are divided by as in the
    reference, so a sample at the mean stays finite.

    On CUDA the kernel is one of several paths, picked from the sizes (and
    the build's architectures) by the op's dispatch table:
    ``fused_ops._paths.table("importance_sampling")`` lists them with their conditions.

    Differentiable with respect to every input, through the fused
    :func:`importance_sampling_backward` op (it recomputes the per-component
    terms; autograd saves the inputs and outputs only, no ``[N, K]`` or
    ``[N, K, D]`` temporaries).  Double backward and forward-mode AD
    (``torch.func.jvp``, dual tensors) are not supported (RuntimeErrors).

    **Batched, mixture proposal, evidence.**  Leading dimensions are
    independent problems: ``samples [..., N, D]``, ``mix_weights [..., K]``,
    ``mix_mus``/``mix_stds [..., K, D]``, ``q_mu``/``q_std [..., D]``
    (broadcast against each other).  ``q_weights [..., Kq]`` makes the
    proposal a diagonal Gaussian mixture, ``q_mu``/``q_std`` then
    ``[..., Kq, D]``.  ``return_evidence=True`` appends the log evidence
    ``log_evidence = logsumexp(log_p - log_q) - log N`` ``[...]`` as a
    fourth output.  Outputs: ``weighted_mean [..., D]``, ``ess [...]``,
    ``log_weights [..., N]`` (normalised) and, asked for, ``log_evidence``.
    Such calls run :func:`fused_ops.importance_log_weights` (the log weights
    of every problem in one kernel) and then :func:`fused_ops.snis` (its
    normalisation, moments and evidence, all sums in double); the plain 2-D
    call with a Gaussian proposal and no evidence runs the fused op above.
    Non-finite log weights then follow ``snis``'s rules, which
    agree with the above (NaN outputs where there is no normaliser) and
    give ``log_evidence = -inf`` where every weight is zero; a problem
    affects no other.  Broadcast arguments are materialised at the batch
    shape (samples shared by all problems: ``B * N * D`` elements).
    """
    if q_weights is not None or return_evidence or _is_batched(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std):
        return _batched(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std, q_weights, return_evidence)
    args, out_dtype = _dtypes.to_compute_dtype(_ARG_NAMES, (samples, mix_weights, mix_mus, mix_stds, q_mu, q_std))
    return _dtypes.from_compute_dtype(_eager.call(_OP, args), out_dtype)


_ARG_NAMES = ("samples", "mix_weights", "mix_mus", "mix_stds", "q_mu", "q_std")
_BATCHED_NAMES = ("samples", "mix_weights", "mix_mus", "mix_stds", "q_mu", "q_std", "q_weights")
_UNBATCHED_RANKS = (2, 1, 2, 2, 1, 1)
# importance_log_weights' arguments as this function names them.
_LW_NAMES = ("samples", "mix_weights", "mix_mus", "mix_stds", "q_weights", "q_mu", "q_std")


def _is_batched(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std):
    """Whether any argument has dimensions beyond its unbatched rank (a
    missing or lower-rank one is left to the unbatched op, which names it).
    Spelled out: this runs on every call of the plain op, whose host time is
    a target."""
    try:
        return (samples.dim() > 2 or mix_weights.dim() > 1 or mix_mus.dim() > 2 or mix_stds.dim() > 2
                or q_mu.dim() > 1 or q_std.dim() > 1)
    except AttributeError:  # None (or not a tensor) before any batched argument
        return any(isinstance(t, Tensor) and t.dim() > r
                   for t, r in zip((samples, mix_weights, mix_mus, mix_stds, q_mu, q_std), _UNBATCHED_RANKS))


def _batched(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std, q_weights, return_evidence):
    """The batched / mixture-proposal / evidence route: importance_log_weights, then snis."""
    args, out_dtype = _dtypes.to_compute_dtype(
        _BATCHED_NAMES, (samples, mix_weights, mix_mus, mix_stds, q_mu, q_std, q_weights))
    samples, mix_weights, mix_mus, mix_stds, q_mu, q_std, q_weights = args
    if q_weights is None:  # a Gaussian proposal: one component of weight 1
        for t, name in ((q_mu, "q_mu"), (q_std, "q_std")):
            if t is None:
                raise RuntimeError(f"{name} must be a 1-D tensor [D] or batched [..., D], got None")
            if t.dim() < 1:
                raise RuntimeError(f"{name} must be a 1-D tensor [D] or batched [..., D], got shape {shape_str(t)}")
        q_mu, q_std = q_mu.unsqueeze(-2), q_std.unsqueeze(-2)
        q_weights = q_mu.new_ones(1)  # no batch dimensions of its own: broadcast to every problem
    flat, batch = flatten_problems((samples, mix_weights, mix_mus, mix_stds, q_weights, q_mu, q_std), broadcast=True,
                                   names=_LW_NAMES)
    check_same_float_dtype_and_device(list(zip(flat, _LW_NAMES)))  # named as the caller named them
    lw = _eager.call(_LW_OP, flat)
    lnw, ess, log_evidence, mean, _ = _eager.call(_SNIS_OP, (lw, flat[0]), False)
    n, d = flat[0].shape[-2], flat[0].shape[-1]
    out = (mean.reshape(*batch, d), ess.reshape(batch), lnw.reshape(*batch, n))
    if return_evidence:
        out = (*out, log_evidence.reshape(batch))
    return _dtypes.from_compute_dtype(out, out_dtype)


def _check_args(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std):
    """The argument rules of csrc/importance_sampling.h's check_importance_sampling_args,
    in its order and with its messages (fused_ops/ops/_checks.py); returns ``(N, D, K)``."""
    check_rank(samples, "samples", 2, "[N, D]")
    check_rank(mix_weights, "mix_weights", 1, "[K]")
    check_rank(mix_mus, "mix_mus", 2, "[K, D]")
    check_rank(mix_stds, "mix_stds", 2, "[K, D]")
    check_rank(q_mu, "q_mu", 1, "[D]")
    check_rank(q_std, "q_std", 1, "[D]")
    (n, d), k = samples.shape, mix_weights.shape[0]
    check(n >= 1, "samples must hold at least one sample (N >= 1): the self-normalised ",
          "weights are undefined for N = 0, got shape ", shape_str(samples))
    check(k >= 1, "mix_weights must hold at least one mixture component (K >= 1), got shape ",
          shape_str(mix_weights))
    check_size(mix_mus, "mix_mus", 0, k, "K, the number of mixture components in mix_weights")
    check_size(mix_mus, "mix_mus", 1, d, "D, the sample dimension of samples")
    check_size(mix_stds, "mix_stds", 0, k, "K, the number of mixture components in mix_weights")
    check_size(mix_stds, "mix_stds", 1, d, "D, the sample dimension of samples")
    check_size(q_mu, "q_mu", 0, d, "D, the sample dimension of samples")
    check_size(q_std, "q_std", 0, d, "D, the sample dimension of samples")
    check_same_float_dtype_and_device([
        (samples, "samples"), (mix_weights, "mix_weights"), (mix_mus, "mix_mus"), (mix_stds, "mix_stds"),
        (q_mu, "q_mu"), (q_std, "q_std"),
    ])
    return n, d, k


@torch.library.register_fake("fused_ops::importance_sampling")
def _importance_sampling_fake(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std):
    n, d, _ = _check_args(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std)
    return samples.new_empty(d), samples.new_empty(()), samples.new_empty(n)


def importance_sampling_backward(
    grad_weighted_mean, grad_ess, grad_log_weights,
    samples, mix_weights, mix_mus, mix_stds, q_mu, q_std,
    weighted_mean, log_weights,
):
    r"""Fused backward of :func:`importance_sampling` (what autograd calls).

    Takes the upstream gradients of ``weighted_mean [D]``, ``ess []`` and
    ``log_weights [N]`` (any of them may be ``None``: zero), the forward's
    inputs and its outputs ``weighted_mean`` and ``log_weights``; returns the
    gradients of ``(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std)``,
    contiguous, with the inputs' shapes.

    Math, with ``w = exp(log_weights)``, ``lw = log_p - log_q`` the
    unnormalised log weights and the responsibilities
    ``r[i,k] = softmax_k(log_comp[i,k] + log mix_weights[k])`` (recomputed in
    the kernel, not stored)::

        g[i] = dL/dlw[i] = gL[i] - w[i]*sum(gL) + w[i]*(x[i]-mean).gM + gE*2*w[i]*(S-w[i])/S**2
        z[i,k,d] = (x[i,d]-mix_mus[k,d])/mix_stds[k,d];   zq[i,d] = (x[i,d]-q_mu[d])/q_std[d]
        grad_samples[i,d]  = g[i]*zq[i,d]/q_std[d] - sum_k g[i]*r[i,k]*z[i,k,d]/mix_stds[k,d] + w[i]*gM[d]
        grad_mix_mus[k,d]  = sum_i g[i]*r[i,k]*z[i,k,d] / mix_stds[k,d]
        grad_mix_stds[k,d] = sum_i g[i]*r[i,k]*(z[i,k,d]**2 - 1) / mix_stds[k,d]
        grad_mix_weights[k] = sum_i g[i]*r[i,k] / mix_weights[k]
        grad_q_mu[d]  = -sum_i g[i]*zq[i,d] / q_std[d]
        grad_q_std[d] = -sum_i g[i]*(zq[i,d]**2 - 1) / q_std[d]

    with ``S = sum_j w[j]**2 = 1/ess``.  Near a dominant sample ``S - w[i]``
    cancels, so the ESS term is evaluated in double with ``S`` recomputed
    from ``log_weights`` (renormalised) rather than taken from the separately
    rounded forward output ``ess``, which is why ``ess`` is not an argument.

    CPU: two passes over fixed chunks of samples (sum of gL, then the
    per-sample work and chunk partials), merged in chunk order, in double.
    CUDA: one cooperative launch; per-sample work in parallel over N, the sums
    over N as per-block partials reduced in a fixed order (no atomics).  Both
    are bitwise reproducible.  Temporary memory: O(chunks * K * D) on the CPU,
    O(blocks * K * D) on CUDA, no [N, K] or [N, K, D] buffers.

    Not differentiable itself: double backward raises a ``RuntimeError``.
    """
    return _eager.call(
        _BACKWARD_OP,
        (grad_weighted_mean, grad_ess, grad_log_weights,
         samples, mix_weights, mix_mus, mix_stds, q_mu, q_std,
         weighted_mean, log_weights),
    )


def _check_backward_args(grad_weighted_mean, grad_ess, grad_log_weights,
                         samples, mix_weights, mix_mus, mix_stds, q_mu, q_std,
                         weighted_mean, log_weights):
    """The rules of csrc/importance_sampling.h's ImportanceSamplingBackwardCall."""
    n, d, k = _check_args(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std)
    check_rank(weighted_mean, "weighted_mean", 1, "[D]")
    check_size(weighted_mean, "weighted_mean", 0, d, "D, the sample dimension of samples")
    check_rank(log_weights, "log_weights", 1, "[N]")
    check_size(log_weights, "log_weights", 0, n, "N, the number of samples")
    check_same_float_dtype_and_device([(samples, "samples"), (weighted_mean, "weighted_mean"),
                                       (log_weights, "log_weights")])
    if grad_weighted_mean is not None:
        check_rank(grad_weighted_mean, "grad_weighted_mean", 1, "[D]")
        check_size(grad_weighted_mean, "grad_weighted_mean", 0, d, "D, the sample dimension of samples")
        check_same_float_dtype_and_device([(samples, "samples"), (grad_weighted_mean, "grad_weighted_mean")])
    if grad_ess is not None:
        check_rank(grad_ess, "grad_ess", 0, "[]")
        check_same_float_dtype_and_device([(samples, "samples"), (grad_ess, "grad_ess")])
    if grad_log_weights is not None:
        check_rank(grad_log_weights, "grad_log_weights", 1, "[N]")
        check_size(grad_log_weights, "grad_log_weights", 0, n, "N, the number of samples")
        check_same_float_dtype_and_device([(samples, "samples"), (grad_log_weights, "grad_log_weights")])


@torch.library.register_fake("fused_ops::importance_sampling_backward")
def _importance_sampling_backward_fake(
    grad_weighted_mean, grad_ess, grad_log_weights,
    samples, mix_weights, mix_mus, mix_stds, q_mu, q_std,
    weighted_mean, log_weights,
):
    _check_backward_args(grad_weighted_mean, grad_ess, grad_log_weights, samples, mix_weights, mix_mus,
                         mix_stds, q_mu, q_std, weighted_mean, log_weights)
    # Contiguous, like the kernels' outputs.
    return tuple(t.new_empty(t.shape) for t in (samples, mix_weights, mix_mus, mix_stds, q_mu, q_std))


# Autograd: the fused backward op, itself not differentiable.


def _importance_sampling_setup_context(ctx, inputs, output):
    # The inputs and two outputs (weighted_mean [D], normalised log_weights
    # [N]): O(N + D) beyond the inputs.  The responsibilities [N, K] are
    # recomputed by the backward kernel, never stored; so is ess (from
    # log_weights, see importance_sampling_backward).
    weighted_mean, _, log_weights = output
    ctx.save_for_backward(*inputs, weighted_mean, log_weights)
    ctx.set_materialize_grads(False)  # the backward op takes None for an unused output


def _importance_sampling_backward(ctx, grad_mean, grad_ess, grad_log_weights):
    return _eager.call(_BACKWARD_OP, (grad_mean, grad_ess, grad_log_weights, *ctx.saved_tensors))


_eager.forbid_double_backward(_BACKWARD_OP, "importance_sampling", "fused_ops.reference.importance_sampling")
_eager.register_autograd(_OP, _importance_sampling_backward, _importance_sampling_setup_context)
