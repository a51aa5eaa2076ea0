"""Python API of the fused ops: one function per op, with its fake (meta)
implementation and autograd registration beside it.

The kernels are registered from C++ (csrc/); this file adds what
``torch.compile`` and autograd need and documents the math.
"""

import torch
from torch import Tensor

__all__ = ["importance_sampling", "flow_euler"]


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

    Differentiable with respect to every input, through the fused
    :func:`importance_sampling_backward` op (it recomputes the per-component
    terms; autograd saves the inputs and outputs only, no ``[N, K]`` or
    ``[N, K, D]`` temporaries).  Double backward is not supported.
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
    # The inputs and the outputs (weighted_mean [D], ess [], normalised
    # log_weights [N]): O(N + D) beyond the inputs.  The responsibilities
    # [N, K] are recomputed by the backward kernel, never stored.
    weighted_mean, ess, log_weights = output
    ctx.save_for_backward(*inputs, weighted_mean, ess, log_weights)


def _importance_sampling_backward(ctx, grad_mean, grad_ess, grad_log_weights):
    return torch.ops.fused_ops.importance_sampling_backward.default(
        grad_mean, grad_ess, grad_log_weights, *ctx.saved_tensors
    )


def importance_sampling_backward(
    grad_weighted_mean, grad_ess, grad_log_weights,
    samples, mix_weights, mix_mus, mix_stds, q_mu, q_std,
    weighted_mean, ess, log_weights,
):
    r"""Fused backward of :func:`importance_sampling` (what autograd calls).

    Takes the upstream gradients of ``weighted_mean [D]``, ``ess []`` and
    ``log_weights [N]`` (any of them may be ``None``: zero), the forward's
    inputs and its outputs; returns the gradients of ``(samples, mix_weights,
    mix_mus, mix_stds, q_mu, q_std)``, contiguous, with the inputs' shapes.

    Math, with ``w = exp(log_weights)``, ``lw = log_p - log_q`` the
    unnormalised log weights and the responsibilities
    ``r[i,k] = softmax_k(log_comp[i,k] + log mix_weights[k])`` (recomputed in
    the kernel, not stored)::

        g[i] = dL/dlw[i] = gL[i] - w[i]*sum(gL) + w[i]*(x[i]-mean).gM + gE*2*ess*w[i]*(1-ess*w[i])
        z[i,k,d] = (x[i,d]-mix_mus[k,d])/mix_stds[k,d];   zq[i,d] = (x[i,d]-q_mu[d])/q_std[d]
        grad_samples[i,d]  = g[i]*zq[i,d]/q_std[d] - sum_k g[i]*r[i,k]*z[i,k,d]/mix_stds[k,d] + w[i]*gM[d]
        grad_mix_mus[k,d]  = sum_i g[i]*r[i,k]*z[i,k,d] / mix_stds[k,d]
        grad_mix_stds[k,d] = sum_i g[i]*r[i,k]*(z[i,k,d]**2 - 1) / mix_stds[k,d]
        grad_mix_weights[k] = sum_i g[i]*r[i,k] / mix_weights[k]
        grad_q_mu[d]  = -sum_i g[i]*zq[i,d] / q_std[d]
        grad_q_std[d] = -sum_i g[i]*(zq[i,d]**2 - 1) / q_std[d]

    CPU: two passes over fixed chunks of samples (sum of gL, then the
    per-sample work and chunk partials), merged in chunk order, in double.
    CUDA: one cooperative launch; per-sample work in parallel over N, the sums
    over N as per-block partials reduced in a fixed order (no atomics).  Both
    are bitwise reproducible.  Temporary memory: O(chunks * K * D) on the CPU,
    O(blocks * K * D) on CUDA, no [N, K] or [N, K, D] buffers.

    Not differentiable itself: double backward raises a ``RuntimeError``.
    """
    return torch.ops.fused_ops.importance_sampling_backward.default(
        grad_weighted_mean, grad_ess, grad_log_weights,
        samples, mix_weights, mix_mus, mix_stds, q_mu, q_std,
        weighted_mean, ess, log_weights,
    )


@torch.library.register_fake("fused_ops::importance_sampling_backward")
def _importance_sampling_backward_fake(
    grad_weighted_mean, grad_ess, grad_log_weights,
    samples, mix_weights, mix_mus, mix_stds, q_mu, q_std,
    weighted_mean, ess, log_weights,
):
    torch._check(samples.dim() == 2, lambda: f"samples must be a 2-D tensor [N, D], got {samples.shape}")
    return tuple(t.new_empty(t.shape) for t in (samples, mix_weights, mix_mus, mix_stds, q_mu, q_std))


def _importance_sampling_backward_setup_context(ctx, inputs, output):
    pass


def _importance_sampling_double_backward(ctx, *grads):
    raise RuntimeError(
        "fused_ops.importance_sampling does not support double backward: its fused backward "
        "(fused_ops::importance_sampling_backward) is not differentiable. Differentiate "
        "fused_ops.reference.importance_sampling instead for higher-order gradients "
        "(e.g. create_graph=True, gradient penalties, Hessian-vector products)."
    )


torch.library.register_autograd(
    "fused_ops::importance_sampling_backward",
    _importance_sampling_double_backward,
    setup_context=_importance_sampling_backward_setup_context,
)


torch.library.register_autograd(
    "fused_ops::importance_sampling",
    _importance_sampling_backward,
    setup_context=_importance_sampling_setup_context,
)


# ---------------------------------------------------------------------------
# flow_euler
# ---------------------------------------------------------------------------


def flow_euler(
    x0: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    w3: Tensor,
    b3: Tensor,
    num_steps: int,
) -> Tensor:
    r"""Probability-flow ODE sampler: ``num_steps`` Euler steps of an MLP
    velocity field, in one fused kernel (one launch on CUDA).

    Shapes: ``x0 [B, D]``, ``w1 [H, D+1]``, ``b1 [H]``, ``w2 [H, H]``,
    ``b2 [H]``, ``w3 [D, H]``, ``b3 [D]`` (the weights and biases of
    ``Linear(D+1, H)``, ``Linear(H, H)``, ``Linear(H, D)``, in ``nn.Linear``'s
    ``[out, in]`` layout); all float32 or all float64, on one device.  The
    hidden width ``H`` comes from the weights.  ``num_steps >= 1``.

    Math, with ``dt = 1 / num_steps``::

        x = x0
        for k in range(num_steps):
            t = (k + 0.5) / num_steps                      # midpoint time, the LAST input feature
            h = silu([x, t] @ w1.T + b1)
            h = silu(h @ w2.T + b2)
            x = x + dt * (h @ w3.T + b3)

    Returns ``x [B, D]`` (contiguous).  Results are bitwise reproducible for
    the same inputs on the same device.  ``dt`` and ``t`` are rounded from
    double to the tensors' dtype, as ``torch.tensor(1.0 / num_steps)`` rounds
    the reference module's ``dt`` buffer in float32.

    Differentiable with respect to every tensor input; the backward recomputes
    the trajectory (``O(num_steps * B * D)`` memory) and runs the steps in reverse.
    """
    return torch.ops.fused_ops.flow_euler.default(x0, w1, b1, w2, b2, w3, b3, num_steps)


@torch.library.register_fake("fused_ops::flow_euler")
def _flow_euler_fake(x0, w1, b1, w2, b2, w3, b3, num_steps):
    torch._check(x0.dim() == 2, lambda: f"x0 must be a 2-D tensor [B, D], got {x0.shape}")
    torch._check(num_steps >= 1, lambda: f"num_steps must be at least 1, got {num_steps}")
    b, d = x0.shape
    return x0.new_empty((b, d))  # contiguous, like the kernels' output


def _flow_euler_setup_context(ctx, inputs, output):
    *tensors, num_steps = inputs
    ctx.num_steps = num_steps
    ctx.save_for_backward(*tensors)


def _silu_and_grad(a):
    s = torch.sigmoid(a)
    return a * s, s * (1 + a * (1 - s))


def _flow_euler_backward(ctx, grad_x):
    x0, w1, b1, w2, b2, w3, b3 = ctx.saved_tensors
    n = ctx.num_steps
    dt = 1.0 / n
    d = x0.shape[1]
    # Recompute the trajectory x_0 .. x_{n-1} in the reference's math (plain
    # torch ops, so the backward also traces under torch.compile), then
    # propagate through the steps in reverse.
    xs = [x0]
    for k in range(n - 1):
        u = torch.cat([xs[-1], torch.full_like(xs[-1][:, :1], (k + 0.5) / n)], dim=-1)
        h = torch.nn.functional.silu(u @ w1.T + b1)
        h = torch.nn.functional.silu(h @ w2.T + b2)
        xs.append(xs[-1] + dt * (h @ w3.T + b3))
    gx = grad_x
    gw1, gb1, gw2, gb2, gw3, gb3 = (torch.zeros_like(w) for w in (w1, b1, w2, b2, w3, b3))
    for k in reversed(range(n)):
        u = torch.cat([xs[k], torch.full_like(xs[k][:, :1], (k + 0.5) / n)], dim=-1)
        h1, dh1 = _silu_and_grad(u @ w1.T + b1)
        h2, dh2 = _silu_and_grad(h1 @ w2.T + b2)
        gv = gx * dt
        gw3 = gw3 + gv.T @ h2
        gb3 = gb3 + gv.sum(0)
        ga2 = (gv @ w3) * dh2
        gw2 = gw2 + ga2.T @ h1
        gb2 = gb2 + ga2.sum(0)
        ga1 = (ga2 @ w2) * dh1
        gw1 = gw1 + ga1.T @ u
        gb1 = gb1 + ga1.sum(0)
        gx = gx + (ga1 @ w1)[:, :d]
    return gx, gw1, gb1, gw2, gb2, gw3, gb3, None


torch.library.register_autograd(
    "fused_ops::flow_euler",
    _flow_euler_backward,
    setup_context=_flow_euler_setup_context,
)
