"""``fused_ops.resample``: multinomial, stratified and systematic resampling
of (normalised or not) log weights to indices.

The function, the fake (meta) implementation with the C++ checks
(csrc/resample.h), and no autograd: the outputs are integer indices.  The
kernels are registered from C++ (``csrc/cpu/resample/``,
``csrc/cuda/resample/``).
"""

import operator

import torch
from torch import Tensor

from . import _dtypes
from ._checks import check, check_size, device_str, dtype_str, shape_str

__all__ = ["resample", "METHODS"]

_OP = torch.ops.fused_ops.resample.default

#: The resampling methods, as ``method`` names them.
METHODS = ("multinomial", "stratified", "systematic")


def resample(
    log_weights: Tensor,
    num_samples: int | None = None,
    method: str = "systematic",
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
) -> Tensor:
    r"""Resample indices from log weights, in one fused kernel per call.

    Shapes: ``log_weights [..., N]`` float32 or float64 (normalised or not:
    only differences matter), CPU or CUDA; leading dimensions are independent
    problems.  Returns int64 ``indices [..., M]``, ``M = num_samples``
    (default ``N``), each in ``[0, N)``.  Any ``N >= 1`` and ``M >= 0``,
    also beyond the 2**24 categories ``torch.multinomial`` accepts.

    This function also takes bfloat16/float16 log weights (and any under
    ``torch.autocast``): they are searched in float32, as
    ``fused_ops/ops/_dtypes.py`` rules; ``uniforms`` stay float64 and the
    indices int64 whatever the log weights' dtype.

    Math, per problem, with ``w_i = exp(lw_i - max lw)`` and the float64 CDF
    ``C_i = w_0 + ... + w_i``: sorted positions ``p_0 <= ... <= p_{M-1}`` in
    ``[0, 1)`` are searched in the CDF::

        indices[k] = min{ i : C_i > p_k * C_{N-1} }

    (never an index of zero weight), where, from uniforms ``u`` in ``[0, 1)``::

        multinomial:  p_k = 1 - exp(sum_{j<=k} log1p(-u_j) / (M - j))   # u [..., M]
        stratified:   p_k = (k + u_k) / M                               # u [..., M]
        systematic:   p_k = (k + u_0) / M                               # u [..., 1]

    The multinomial positions are the order statistics of M uniforms,
    generated in ascending order (no sort): the indices are an i.i.d.
    multinomial sample of the weights, returned sorted.  For every method the
    indices come out ascending; permute them (``torch.randperm``) if the
    order matters.  Stratified and systematic counts of index ``i`` are within
    one of ``M * w_i / sum(w)``.

    Randomness: ``uniforms`` given (float64, the shape above) makes the call
    a pure function of its inputs; otherwise they are drawn here with
    ``torch.rand(..., dtype=torch.float64, generator=generator)`` on
    ``log_weights``' device, so a seeded generator gives the same indices.
    The op (``torch.ops.fused_ops.resample(log_weights, uniforms,
    num_samples, method)``) takes the uniforms, so it is deterministic and
    can be captured in a CUDA graph; under ``torch.compile`` pass
    ``uniforms`` or leave ``generator`` None.

    Log weights must be finite or ``-inf`` (zero weight), with at least one
    finite per problem.  Otherwise the CPU kernel raises a ``RuntimeError``
    naming the problem; the CUDA kernels (which never synchronise with the
    host) write ``-1`` to every index of that problem.

    Not differentiable: the indices are integers (gather with them; use the
    weights themselves for gradients).
    """
    if not isinstance(method, str) or method not in METHODS:
        raise RuntimeError(f"method must be 'multinomial', 'stratified' or 'systematic', got {method!r}")
    if num_samples is None:
        if log_weights is not None and log_weights.dim() >= 1:
            num_samples = log_weights.shape[-1]
    elif isinstance(num_samples, bool):
        raise TypeError("num_samples must be an int, got bool")
    else:
        num_samples = operator.index(num_samples)
    # Only the log weights follow the inputs' dtype (uniforms are float64
    # draws, the indices int64), so they alone are cast.
    (log_weights,), _ = _dtypes.to_compute_dtype(("log_weights",), (log_weights,))
    if uniforms is None:
        _check_log_weights(log_weights)
        check(num_samples >= 0, "num_samples must be >= 0, got ", num_samples)
        count = 1 if method == "systematic" else num_samples
        uniforms = torch.rand((*log_weights.shape[:-1], count), dtype=torch.float64,
                              device=log_weights.device, generator=generator)
    return _OP(log_weights, uniforms, num_samples, method)


def _check_log_weights(log_weights):
    if log_weights is None:
        raise RuntimeError("log_weights must be a 1-D tensor [N] or a batch of them [..., N], got None")
    check(log_weights.dim() >= 1, "log_weights must be a 1-D tensor [N] or a batch of them [..., N], got shape ",
          shape_str(log_weights))


def _check_args(log_weights, uniforms, num_samples, method):
    """The rules of csrc/resample.h's ResampleCall, in its order and with its messages."""
    _check_log_weights(log_weights)
    rank = log_weights.dim()
    check(method in METHODS, "method must be 'multinomial', 'stratified' or 'systematic', got '", method, "'")
    check(num_samples >= 0, "num_samples must be >= 0, got ", num_samples)
    n = log_weights.shape[-1]
    check(n >= 1, "log_weights must hold at least one weight per problem (N >= 1): there is ",
          "nothing to resample from, got shape ", shape_str(log_weights))
    count = 1 if method == "systematic" else num_samples
    if uniforms is None:
        raise RuntimeError(f"uniforms must be a {rank}-D tensor [..., U] (the batch shape of log_weights, "
                           "then U), got None")
    check(uniforms.dim() == rank, "uniforms must be a ", rank,
          "-D tensor [..., U] (the batch shape of log_weights, then U), got shape ", shape_str(uniforms))
    for d in range(rank - 1):
        check_size(uniforms, "uniforms", d, log_weights.shape[d], "the batch shape of log_weights")
    check_size(uniforms, "uniforms", rank - 1, count,
               "one uniform per problem for systematic resampling" if method == "systematic"
               else "num_samples: one uniform per sample")
    check(log_weights.dtype in (torch.float32, torch.float64), "log_weights must be float32 or float64, got ",
          dtype_str(log_weights.dtype))
    check(uniforms.dtype == torch.float64, "uniforms must be float64 (draws in [0, 1)), got ",
          dtype_str(uniforms.dtype))
    check(uniforms.device == log_weights.device, "uniforms must be on the same device as log_weights (",
          device_str(log_weights), "), got ", device_str(uniforms))


@torch.library.register_fake("fused_ops::resample")
def _resample_fake(log_weights, uniforms, num_samples, method):
    _check_args(log_weights, uniforms, num_samples, method)
    return log_weights.new_empty((*log_weights.shape[:-1], num_samples), dtype=torch.int64)
