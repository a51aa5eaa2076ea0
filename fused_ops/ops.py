"""Python API of the fused ops: one function per op, with its fake (meta)
implementation and autograd registration beside it.

The kernels are registered from C++ (csrc/); this file adds what
``torch.compile`` and autograd need and documents the math.
"""

import torch
from torch import Tensor

__all__ = ["importance_sampling"]


# ---------------------------------------------------------------------------
# importance_sampling
# ---------------------------------------------------------------------------


def importance_sampling(
    samples: Tensor,
    mix_weights: Tensor,
    mix_mus: Tensor,
    mix_stds: Tensor,
    q_mu: Tensor,
    q_std: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Self-normalised importance sampling of a Gaussian-mixture target with a
    diagonal Gaussian proposal, in one fused kernel.

    Shapes: ``samples [N, D]``, ``mix_weights [K]``, ``mix_mus [K, D]``,
    ``mix_stds [K, D]``, ``q_mu [D]``, ``q_std [D]``; all float32 or all
    float64, on one device (CPU or CUDA).  ``N >= 1``, ``K >= 1``.

    Math (the constant :math:`-\tfrac12\log 2\pi` terms cancel and are omitted)::

        log_p[i] = logsumexp_k( log w_k + sum_d( -0.5*((x[i,d]-mu[k,d])/std[k,d])**2 - log std[k,d] ) )
        log_q[i] = sum_d( -0.5*((x[i,d]-q_mu[d])/q_std[d])**2 - log q_std[d] )
        log_weights = (log_p - log_q) - logsumexp(log_p - log_q)       # over all N
        weighted_mean = sum_i exp(log_weights[i]) * x[i]              # [D]
        ess = 1 / sum_i exp(log_weights[i])**2                        # 0-d

    Returns ``(weighted_mean [D], ess [], log_weights [N])``.  ``log_weights``
    are normalised (``logsumexp == 0``), ready for resampling.  Results are
    bitwise reproducible for the same inputs on the same device.

    Differentiable with respect to every input (the backward recomputes the
    per-component terms, ``O(N*K*D)`` temporary memory).
    """
    return torch.ops.fused_ops.importance_sampling.default(
        samples, mix_weights, mix_mus, mix_stds, q_mu, q_std
    )


@torch.library.register_fake("fused_ops::importance_sampling")
def _importance_sampling_fake(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std):
    torch._check(samples.dim() == 2, lambda: f"samples must be a 2-D tensor [N, D], got {samples.shape}")
    n, d = samples.shape
    return samples.new_empty(d), samples.new_empty(()), samples.new_empty(n)


def _importance_sampling_setup_context(ctx, inputs, output):
    weighted_mean, ess, log_weights = output
    ctx.save_for_backward(*inputs, weighted_mean, ess, log_weights)


def _importance_sampling_backward(ctx, grad_mean, grad_ess, grad_log_weights):
    x, mix_weights, mix_mus, mix_stds, q_mu, q_std, mean, ess, log_w = ctx.saved_tensors
    w = log_w.exp()
    # Gradient with respect to the unnormalised log weights lw = log_p - log_q.
    grad_lw = torch.zeros_like(w)
    if grad_log_weights is not None:
        grad_lw = grad_lw + grad_log_weights - w * grad_log_weights.sum()
    if grad_mean is not None:
        grad_lw = grad_lw + w * ((x - mean) @ grad_mean)
    if grad_ess is not None:
        grad_lw = grad_lw + grad_ess * 2 * ess * w * (1 - ess * w)

    # Recompute the per-component terms (N, K, D) and responsibilities (N, K).
    z = (x[:, None, :] - mix_mus) / mix_stds
    log_comp = (-0.5 * z**2 - mix_stds.log()).sum(-1) + mix_weights.log()
    resp = torch.softmax(log_comp, dim=-1)
    gr = grad_lw[:, None] * resp  # d loss / d log_comp
    zq = (x - q_mu) / q_std

    grad_x = grad_lw[:, None] * (zq / q_std - (resp[:, :, None] * z / mix_stds).sum(1))
    if grad_mean is not None:
        grad_x = grad_x + w[:, None] * grad_mean
    grad_mix_mus = torch.einsum("nk,nkd->kd", gr, z) / mix_stds
    grad_mix_stds = (torch.einsum("nk,nkd->kd", gr, z**2) - gr.sum(0)[:, None]) / mix_stds
    grad_mix_weights = gr.sum(0) / mix_weights
    grad_q_mu = -(grad_lw @ zq) / q_std
    grad_q_std = -(grad_lw @ zq**2 - grad_lw.sum()) / q_std
    return grad_x, grad_mix_weights, grad_mix_mus, grad_mix_stds, grad_q_mu, grad_q_std


torch.library.register_autograd(
    "fused_ops::importance_sampling",
    _importance_sampling_backward,
    setup_context=_importance_sampling_setup_context,
)
