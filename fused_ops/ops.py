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


# ---------------------------------------------------------------------------
# vae_elbo
# ---------------------------------------------------------------------------

__all__.append("vae_elbo")


def vae_elbo(
    x: Tensor,
    eps: Tensor,
    w_enc: Tensor,
    b_enc: Tensor,
    w_mu: Tensor,
    b_mu: Tensor,
    w_logvar: Tensor,
    b_logvar: Tensor,
    w_dec1: Tensor,
    b_dec1: Tensor,
    w_dec2: Tensor,
    b_dec2: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Forward pass of a one-hidden-layer VAE with reparameterisation, BCE
    reconstruction loss and KL term, in one fused kernel.

    Shapes: ``x [B, I]`` (values in [0, 1]), ``eps [B, L]``, ``w_enc [H, I]``,
    ``b_enc [H]``, ``w_mu [L, H]``, ``b_mu [L]``, ``w_logvar [L, H]``,
    ``b_logvar [L]``, ``w_dec1 [H, L]``, ``b_dec1 [H]``, ``w_dec2 [I, H]``,
    ``b_dec2 [I]`` (``nn.Linear`` weight layout); all float32 or all float64,
    on one device (CPU or CUDA).

    Math (exactly ``fused_ops.reference.VAE``)::

        h      = relu(x @ w_enc.T + b_enc)
        mu     = h @ w_mu.T + b_mu ;  logvar = h @ w_logvar.T + b_logvar
        z      = mu + exp(0.5 * logvar) * eps
        p      = sigmoid(relu(z @ w_dec1.T + b_dec1) @ w_dec2.T + b_dec2)   # 1/(1+exp(-a))
        recon  = sum_i( (x-1) * max(log1p(-p), -100) - x * max(log(p), -100) )  # PyTorch's BCE
        kl     = -0.5 * sum_l( 1 + logvar - mu**2 - exp(logvar) )
        elbo   = -(recon + kl)

    The clamp at -100 is PyTorch's ``binary_cross_entropy``'s: once the logit
    passes ~17, ``p`` rounds to exactly 1.0 in float32 and the clamp applies.

    Returns ``(elbo [B], recon [B], kl [B])``.  Neither the hidden activations
    nor the reconstruction are materialised.  Results are bitwise reproducible
    for the same inputs on the same device.

    Differentiable with respect to every input through the fused backward op
    ``fused_ops::vae_elbo_backward`` (see :func:`_vae_elbo_backward`).  Only the
    inputs are saved for the backward (no extra memory beyond references to
    them); the backward recomputes h, mu, logvar, z, the decoder hidden layer
    and p.  Double backward is not supported (a RuntimeError).
    """
    return torch.ops.fused_ops.vae_elbo.default(
        x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2
    )


@torch.library.register_fake("fused_ops::vae_elbo")
def _vae_elbo_fake(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2):
    torch._check(x.dim() == 2, lambda: f"x must be a 2-D tensor [B, I], got {x.shape}")
    torch._check(eps.dim() == 2, lambda: f"eps must be a 2-D tensor [B, L], got {eps.shape}")
    torch._check(eps.shape[0] == x.shape[0], lambda: f"eps.shape[0] must be B={x.shape[0]}, got {eps.shape}")
    b = x.shape[0]
    return x.new_empty(b), x.new_empty(b), x.new_empty(b)


def _vae_elbo_setup_context(ctx, inputs, output):
    # Saves the 12 inputs only -- no activations: the backward op recomputes
    # h, mu, logvar, z, the decoder hidden layer and p (one extra forward's
    # products, cheaper than keeping B * (2H + 3L + I) activations alive
    # between forward and backward).
    ctx.save_for_backward(*inputs)


def _vae_elbo_backward(ctx, grad_elbo, grad_recon, grad_kl):
    r"""Backward of :func:`vae_elbo` through the fused op
    ``fused_ops::vae_elbo_backward`` (CPU and CUDA kernels, csrc/).

    With per-row upstream gradients ``d_recon = grad_recon - grad_elbo`` and
    ``d_kl = grad_kl - grad_elbo`` (a missing one counts as zero), it applies
    the gradients PyTorch's autograd applies to the reference::

        ga3  = d_recon * (p - x) / max((1 - p) * p, 1e-12) * (1 - p) * p   # BCE backward, clamp
                                                                           # included, then sigmoid's
        gx   = d_recon * -logit(p) + ga1 @ w_enc                           # BCE's target gradient
        ga2  = (ga3 @ w_dec2) * (g > 0);      gz = ga2 @ w_dec1
        gmu  = gz + d_kl * mu;  glv = 0.5 * gz * eps * std - 0.5 * d_kl * (1 - exp(logvar))
        geps = gz * std;        ga1 = (gmu @ w_mu + glv @ w_logvar) * (h > 0)
        gW   = ga^T @ input of the layer, gb = ga.sum(0)   for every layer

    At saturated ``p`` (exactly 0 or 1) ``-logit(p)`` is infinite, as in the
    reference: ``gx`` is +-inf there wherever ``d_recon != 0``; a row whose
    ``d_recon`` is exactly zero gets no BCE target term (where the
    reference's autograd would not reach the BCE node, or form 0 * inf).

    Memory: nothing saved beyond the inputs (no activations are kept between
    forward and backward); while it runs the backward op holds, besides the
    gradients, ``B * (I + 4H + 3L)`` scratch elements on the CPU and
    ``B * (I + 4H + 6L) + 2LH`` on CUDA (784-256-32 at B=8192 in float32:
    ~60 MB on the CPU, ~65 MB on CUDA), freed when it returns.

    CPU: row blocks of 64 samples in parallel recompute the forward and run
    the chain rule (BLAS products + fused epilogues); each weight gradient is
    one product over all rows, each bias gradient a column sum in row order.
    CUDA: 13 cuBLAS products and 9 small kernels (elementwise epilogues,
    all bias gradients in one fixed-order column-sum launch, no atomics).  Both are deterministic.
    """
    return torch.ops.fused_ops.vae_elbo_backward.default(
        grad_elbo, grad_recon, grad_kl, *ctx.saved_tensors
    )


@torch.library.register_fake("fused_ops::vae_elbo_backward")
def _vae_elbo_backward_fake(grad_elbo, grad_recon, grad_kl, *inputs):
    return tuple(t.new_empty(t.shape) for t in inputs)


def _vae_elbo_backward_setup_context(ctx, inputs, output):
    pass


def _vae_elbo_double_backward(ctx, *grads):
    raise RuntimeError(
        "fused_ops.vae_elbo does not support double backward (a gradient of its gradients, "
        "e.g. create_graph=True followed by another backward); use fused_ops.reference.VAE"
    )


torch.library.register_autograd(
    "fused_ops::vae_elbo", _vae_elbo_backward, setup_context=_vae_elbo_setup_context
)
torch.library.register_autograd(
    "fused_ops::vae_elbo_backward",
    _vae_elbo_double_backward,
    setup_context=_vae_elbo_backward_setup_context,
)
