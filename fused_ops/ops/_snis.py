"""``fused_ops.snis``: self-normalised importance sampling of given log
weights (any target: the user's ``log_p - log_q``), batched.

The function, its fused backward, their fake (meta) implementations and the
autograd registration.  The kernels are registered from C++
(``csrc/cuda/snis/``, ``csrc/cpu/snis/``).
"""

import torch
from torch import Tensor

from .. import _eager
from . import _dtypes
from ._checks import check, check_same_float_dtype_and_device, check_size, shape_str

__all__ = ["snis", "snis_backward"]

_OP = torch.ops.fused_ops.snis.default
_BACKWARD_OP = torch.ops.fused_ops.snis_backward.default


def snis(log_weights: Tensor, samples: Tensor | None = None, moments: bool = False):
    r"""Self-normalised importance sampling of given unnormalised log weights.

    Shapes: ``log_weights [..., N]`` (``N >= 1``; the leading dimensions are
    independent problems), ``samples [..., N, D]`` or ``None``; float32 or
    float64, one device (CPU or CUDA).  ``moments=True`` (needs samples)
    also returns the weighted variance.

    Dtypes: all float32 or all float64 (the kernels' rule, which
    ``torch.ops.fused_ops.snis`` keeps); this function also takes
    all-bfloat16 or all-float16 inputs, computes in float32 and returns the
    outputs in the inputs' dtype (gradients too).  Under ``torch.autocast``
    (CPU, CUDA) lower-precision and float32 inputs run in float32 and the
    outputs are float32; float64 inputs stay float64
    (``fused_ops/ops/_dtypes.py``).

    Math, per problem (``lw`` = ``log_weights``, e.g. ``log p(x) - log q(x)``)::

        log_norm_weights = lw - logsumexp(lw)                    # [..., N]
        w = exp(log_norm_weights)
        ess = 1 / sum_i w_i**2                                    # [...]
        log_evidence = logsumexp(lw) - log N                      # [...]: log of the mean weight
        mean = sum_i w_i x_i                                      # [..., D]
        variance = sum_i w_i (x_i - mean)**2                      # [..., D] (moments=True)

    Returns ``(log_norm_weights, ess, log_evidence, mean, variance)``;
    ``mean`` without samples and ``variance`` without ``moments`` are empty
    tensors of shape ``[0]``.

    Numerics: every sum is accumulated in double (float32 inputs too)
    relative to the running maximum, so log weights in the thousands are
    safe.  A ``-inf`` log weight is a zero weight.  A problem whose log
    weights are all ``-inf`` has ``log_evidence = -inf`` and NaN elsewhere;
    one with a NaN or ``+inf`` log weight is NaN in every output.  Results
    are bitwise reproducible for the same inputs on the same device: all
    reductions merge partials in a fixed order (docs/snis.md).

    Differentiable in ``log_weights`` and ``samples`` through the fused
    :func:`snis_backward` op; double backward and forward-mode AD are not
    supported.  Across processes: :func:`fused_ops.distributed.snis`.
    """
    args, out_dtype = _dtypes.to_compute_dtype(_ARG_NAMES, (log_weights, samples))
    return _dtypes.from_compute_dtype(_eager.call(_OP, args, bool(moments)), out_dtype)


_ARG_NAMES = ("log_weights", "samples")


def _check_args(log_weights, samples, moments, lw_name="log_weights"):
    """The rules of csrc/snis.h's check_snis_args, in its order and with its
    messages; returns ``(batch_shape, N, D)``."""
    if log_weights is None:
        raise RuntimeError(f"{lw_name} must be a 1-D tensor [N] or batched [..., N], got None")
    check(log_weights.dim() >= 1, lw_name, " must be a 1-D tensor [N] or batched [..., N], got shape ",
          shape_str(log_weights))
    r = log_weights.dim()
    n = log_weights.shape[-1]
    check(n >= 1, lw_name, " must hold at least one weight per problem (N >= 1): the self-normalised ",
          "weights are undefined for N = 0, got shape ", shape_str(log_weights))
    d = 0
    if samples is not None:
        check(samples.dim() == r + 1, "samples must be a ", r + 1,
              "-D tensor [..., N, D] (the dimensions of ", lw_name, ", then D), got shape ", shape_str(samples))
        for i in range(r):
            check_size(samples, "samples", i, log_weights.shape[i],
                       "N, the number of weights in log_weights" if i + 1 == r else "a batch dimension of log_weights")
        d = samples.shape[r]
        check_same_float_dtype_and_device([(log_weights, lw_name), (samples, "samples")])
    else:
        check_same_float_dtype_and_device([(log_weights, lw_name)])
    check(samples is not None or not moments, "samples must be a ", r + 1,
          "-D tensor [..., N, D] when moments=True (the variance is a moment of the samples), got None")
    return tuple(log_weights.shape[:-1]), n, d


@torch.library.register_fake("fused_ops::snis")
def _snis_fake(log_weights, samples=None, moments=False):
    batch, n, d = _check_args(log_weights, samples, moments)
    new = log_weights.new_empty
    return (new((*batch, n)), new(batch), new(batch), new((*batch, d)) if samples is not None else new(0),
            new((*batch, d)) if moments else new(0))


def snis_backward(grad_log_norm_weights, grad_ess, grad_log_evidence, grad_mean, grad_variance,
                  log_norm_weights, samples, mean, variance):
    r"""Fused backward of :func:`snis` (what autograd calls).

    Takes the upstream gradients of the five outputs (any may be ``None``:
    zero; ``grad_mean`` needs samples, ``grad_variance`` the forward's
    variance), the forward's ``log_norm_weights``, ``samples`` (or ``None``),
    ``mean`` and ``variance`` (empty ``[0]`` where the forward returned
    them empty); returns ``(grad_log_weights [..., N], grad_samples
    [..., N, D])`` (``grad_samples`` empty ``[0]`` without samples).

    Math, with ``w`` the normalised weights and ``Q = sum_i w_i**2``::

        grad_lw[j] = gL[j] - w[j]*sum(gL) + gE*2*w[j]*(Q - w[j])/Q**2 + gZ*w[j]
                     + w[j] * sum_d( gM[d]*(x[j,d]-mean[d]) + gV[d]*((x[j,d]-mean[d])**2 - var[d]) )
        grad_x[j,d] = w[j] * (gM[d] + 2*gV[d]*(x[j,d]-mean[d]))

    ``Q`` is recomputed in double from ``log_norm_weights`` (not taken from
    the rounded ``ess``: ``Q - w[j]`` cancels near a dominant sample).  Not
    differentiable itself.
    """
    return _eager.call(_BACKWARD_OP, (grad_log_norm_weights, grad_ess, grad_log_evidence, grad_mean,
                                      grad_variance, log_norm_weights, samples, mean, variance))


def _check_upstream(g, name, shape, like_name, lnw):
    if g is None:
        return
    check(g.dim() == len(shape), name, " must be a ", len(shape), "-D tensor with the shape of ", like_name, " ",
          "[" + ", ".join(str(s) for s in shape) + "]", ", got shape ", shape_str(g))
    for i, s in enumerate(shape):
        check(g.shape[i] == s, name, ".shape[", i, "] must be ", s, " (the shape of ", like_name, " ",
              "[" + ", ".join(str(v) for v in shape) + "]", "), got shape ", shape_str(g))
    check_same_float_dtype_and_device([(lnw, "log_norm_weights"), (g, name)])


def _check_backward_args(g_lw, g_ess, g_logz, g_mean, g_var, lnw, samples, mean, variance):
    """The rules of csrc/snis.h's SnisBackwardCall."""
    batch, n, d = _check_args(lnw, samples, False, "log_norm_weights")
    has = samples is not None
    d_shape = (*batch, d) if has else (0,)
    _check_upstream(mean, "mean", d_shape, "samples' [..., D]" if has else "an empty tensor", lnw)
    # The forward's variance: [..., D] with moments=True, else an empty [0].
    has_var = has and variance is not None and tuple(variance.shape) == tuple(d_shape)
    if not (variance is not None and tuple(variance.shape) == (0,)):
        _check_upstream(variance, "variance", d_shape, "samples' [..., D], or an empty [0]", lnw)
    _check_upstream(g_lw, "grad_log_norm_weights", (*batch, n), "log_norm_weights", lnw)
    _check_upstream(g_ess, "grad_ess", batch, "ess", lnw)
    _check_upstream(g_logz, "grad_log_evidence", batch, "log_evidence", lnw)
    check(has or g_mean is None, "grad_mean needs samples (the mean is a moment of the samples), got samples None")
    _check_upstream(g_mean, "grad_mean", d_shape, "mean", lnw)
    check(g_var is None or has_var, "grad_variance needs the forward's variance (moments=True)")
    _check_upstream(g_var, "grad_variance", d_shape, "variance", lnw)
    return batch, n, d


@torch.library.register_fake("fused_ops::snis_backward")
def _snis_backward_fake(g_lw, g_ess, g_logz, g_mean, g_var, lnw, samples, mean, variance):
    batch, n, d = _check_backward_args(g_lw, g_ess, g_logz, g_mean, g_var, lnw, samples, mean, variance)
    return lnw.new_empty((*batch, n)), lnw.new_empty((*batch, n, d)) if samples is not None else lnw.new_empty(0)


# Autograd: the fused backward op, itself not differentiable.


def _snis_setup_context(ctx, inputs, output):
    # O(B * (N + D)) beyond the inputs: the normalised log weights and the moments.
    _, samples, _ = inputs
    log_norm_weights, _, _, mean, variance = output
    ctx.has_samples = samples is not None
    ctx.moments = bool(inputs[2])
    ctx.save_for_backward(log_norm_weights, samples, mean, variance)
    ctx.set_materialize_grads(False)  # the backward op takes None for an unused output


def _snis_backward(ctx, g_lw, g_ess, g_logz, g_mean, g_var):
    lnw, samples, mean, variance = ctx.saved_tensors
    # An empty output (mean without samples, variance without moments) has no gradient.
    g_mean = g_mean if g_mean is not None and ctx.has_samples else None
    g_var = g_var if g_var is not None and ctx.moments else None
    grad_lw, grad_x = _eager.call(_BACKWARD_OP, (g_lw, g_ess, g_logz, g_mean, g_var, lnw, samples, mean, variance))
    return grad_lw, (grad_x if ctx.has_samples else None), None


_eager.forbid_double_backward(_BACKWARD_OP, "snis", "fused_ops.reference.snis")
_eager.register_autograd(_OP, _snis_backward, _snis_setup_context)
