"""Python API of the fused ops: one function per op, with its fake (meta)
implementation and autograd registration beside it.

The kernels are registered from C++ (csrc/); this file adds what
``torch.compile`` and autograd need and documents the math.
"""

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

__all__ = ["importance_sampling", "flow_euler", "flow_euler_backward"]


def _forbid_double_backward(name, reference):
    """Registers autograd for ``fused_ops::<name>_backward`` that raises: the
    fused backward ops are not themselves differentiable, and a clear error
    beats a silently wrong second derivative."""

    def backward(ctx, *grads):
        raise RuntimeError(
            f"fused_ops.{name} does not support double backward: double backward through its "
            f"fused backward (fused_ops::{name}_backward; e.g. create_graph=True followed by "
            f"another backward) is not supported; use {reference} for higher-order derivatives"
        )

    _register_autograd(getattr(torch.ops.fused_ops, f"{name}_backward").default, backward, _save_nothing)


def _save_nothing(ctx, inputs, output):
    pass


_any_requires_grad = getattr(torch._C, "_any_requires_grad", None)


def _needs_grad(tensors) -> bool:
    """Whether autograd must record a call on ``tensors``.  Eager calls ask
    torch's own C++ test (what register_autograd's kernel asks: ~1 us less
    Python per 12-tensor call than the generator, 2-core VM), which
    torch.compile cannot trace."""
    if not torch.is_grad_enabled():
        return False
    if _any_requires_grad is not None and not torch.compiler.is_compiling():
        return _any_requires_grad(*tensors)
    return any(t is not None and t.requires_grad for t in tensors)


def _reject_forward_ad(op, tensors) -> None:
    """Raises when forward-mode AD would differentiate this call: the ops
    have no forward derivative (jvp), and without this check their outputs
    would come back silently without tangents -- a zero directional
    derivative from ``torch.func.jvp``.

    Forward AD is on inside ``torch.autograd.forward_ad.dual_level()`` and
    ``torch.func.jvp`` (both make the dual level >= 0); only inputs that carry
    a tangent are refused, so a call on plain tensors inside them still
    works.  Under ``vmap`` inside ``jvp`` a tangent cannot be inspected
    (``unpack_dual`` has no batching rule), so such a call is refused.
    ``torch.ops.fused_ops.*`` called directly is not checked: the autograd
    kernel that ``torch.library.register_autograd`` installs drops the
    tangents silently, which this Python layer cannot intercept.
    """
    if _forward_ad._current_level < 0:  # the common case: one module-global read
        return
    try:
        dual = any(t is not None and _forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    except RuntimeError:  # vmap inside jvp
        dual = True
    if dual:
        raise RuntimeError(
            f"fused_ops::{op._opname} does not support forward-mode AD (torch.func.jvp, "
            f"torch.autograd.forward_ad dual tensors): it has no forward derivative, and its outputs "
            f"would silently carry no tangent. Use reverse mode (backward, torch.autograd.grad, "
            f"torch.func.vjp), or fused_ops.reference for forward mode."
        )


def _call_op(op, tensors, *scalars):
    """``op(*tensors, *scalars)`` for an op with a Python autograd
    registration (the forward ops, and the backward ops whose registration
    forbids double backward).

    When no gradient can flow (grad mode off, or no input requires grad) the
    call goes straight below the Autograd dispatch key.  That is what the
    autograd kernel ``torch.library.register_autograd`` installs does in that
    case (it redispatches past autograd), without its Python round trip:
    boxing every argument into Python and back costs ~7 us per call on the
    H200 test host (``importance_sampling``, 6 tensors; bench/results/
    nvidia-h200-kernel-timing.txt, "op" vs "redispatch") and ~20 us for the
    12 tensors of ``vae_elbo`` on a 2-core VM, as much as a small fused
    kernel (on the H200, the VAE module call at B=128 went from 47.5 to 28.7
    us for a 26 us kernel: bench/results/nvidia-h200-gpu-run.txt, run W and
    the seventh session's run 1).  When a gradient can flow, a forward op
    registered through :func:`_register_autograd` runs as its eager
    ``autograd.Function`` (same ``setup_context`` and backward).  Under
    ``torch.compile`` the op is called as it is, so the graph records the op
    itself.  Eager calls refuse forward-mode AD first
    (:func:`_reject_forward_ad`).
    """
    if torch.compiler.is_compiling():
        return op(*tensors, *scalars)
    _reject_forward_ad(op, tensors)
    if _needs_grad(tensors):
        functions = _EAGER_AUTOGRAD.get(op)
        if functions is None:
            return op(*tensors, *scalars)
        plain, transformable = functions
        function = transformable if torch._C._are_functorch_transforms_active() else plain
        return function.apply(*tensors, *scalars)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*tensors, *scalars)


# op -> (plain, transformable): the torch.autograd.Functions that eager calls
# needing gradients use, outside and inside torch.func transforms.
_EAGER_AUTOGRAD = {}


def _register_autograd(op, backward, setup_context):
    """``torch.library.register_autograd(op, backward, setup_context)``, and
    the same pair as ``torch.autograd.Function``s (named after the op) that
    eager calls through :func:`_call_op` use when a gradient can flow.

    The registration is what ``torch.ops.fused_ops.*`` called directly and
    ``torch.compile`` use.  The Functions skip the Python that the kernel
    register_autograd installs runs on every call: its ``fill_defaults``
    rebuilds the schema's argument list once per argument (~28 us per
    ``vae_elbo`` call on a 2-core VM), and it redispatches from Python.
    Both routes run the same ``setup_context`` and backward, and the tests
    check that they give bitwise the same gradients.  The Functions' forward
    runs the op below the Autograd key: inside it grad mode is off, and the
    registered kernel would otherwise be entered just to redispatch.

    Two Functions, because the form torch.func needs costs time on every
    call: functorch requires a ``setup_context`` staticmethod (which the
    Function register_autograd generates lacks, so ``torch.func.grad`` over
    ``torch.ops.fused_ops.*`` is refused) and, for ``vmap`` of ``grad``
    (per-sample gradients), a vmap rule (``generate_vmap_rule``: forward and
    backward run under vmap, where the ops take torch's per-sample
    fallback); but ``Function.apply`` binds a ``setup_context`` Function's
    arguments through ``inspect.signature`` on every call (~14 us of 21 for
    12 tensors on a 2-core VM).  So the plain Function calls
    ``setup_context`` from its own forward, and the transformable one is
    used only while a torch.func transform is active.  A VAE training step
    at B=128 on the H200 host, in rounds alternating the routes (median of
    7): registered kernel 787 us, transformable Function 682, plain 602
    (bench/results/nvidia-h200-gpu-run.txt, seventeenth session, run 3).
    """
    torch.library.register_autograd(op, backward, setup_context=setup_context)

    def forward(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    def forward_with_context(ctx, *args):
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    plain = type(
        op._opname,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward_with_context), "backward": staticmethod(backward)},
    )
    transformable = type(
        op._opname,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "generate_vmap_rule": True,
        },
    )
    _EAGER_AUTOGRAD[op] = (plain, transformable)


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
    ``[N, K, D]`` temporaries).  Double backward and forward-mode AD
    (``torch.func.jvp``, dual tensors) are not supported (RuntimeErrors).
    """
    return _call_op(
        torch.ops.fused_ops.importance_sampling.default,
        (samples, mix_weights, mix_mus, mix_stds, q_mu, q_std),
    )


@torch.library.register_fake("fused_ops::importance_sampling")
def _importance_sampling_fake(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std):
    torch._check(samples.dim() == 2, lambda: f"samples must be a 2-D tensor [N, D], got {samples.shape}")
    n, d = samples.shape
    return samples.new_empty(d), samples.new_empty(()), samples.new_empty(n)


def _importance_sampling_setup_context(ctx, inputs, output):
    # The inputs and two outputs (weighted_mean [D], normalised log_weights
    # [N]): O(N + D) beyond the inputs.  The responsibilities [N, K] are
    # recomputed by the backward kernel, never stored; so is ess (from
    # log_weights, see importance_sampling_backward).
    weighted_mean, _, log_weights = output
    ctx.save_for_backward(*inputs, weighted_mean, log_weights)
    ctx.set_materialize_grads(False)  # the backward op takes None for an unused output


def _importance_sampling_backward(ctx, grad_mean, grad_ess, grad_log_weights):
    return _call_op(
        torch.ops.fused_ops.importance_sampling_backward.default,
        (grad_mean, grad_ess, grad_log_weights, *ctx.saved_tensors),
    )


def importance_sampling_backward(
    grad_weighted_mean, grad_ess, grad_log_weights,
    samples, mix_weights, mix_mus, mix_stds, q_mu, q_std,
    weighted_mean, log_weights,
):
    r"""Fused backward of :func:`importance_sampling` (what autograd calls).

    Takes the upstream gradients of ``weighted_mean [D]``, ``ess []`` and
    ``log_weights [N]`` (any of them may be ``None``: zero), the forward's
    inputs and its outputs ``weighted_mean`` and ``log_weights``; returns the gradients of ``(samples, mix_weights,
    mix_mus, mix_stds, q_mu, q_std)``, contiguous, with the inputs' shapes.

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
    return _call_op(
        torch.ops.fused_ops.importance_sampling_backward.default,
        (grad_weighted_mean, grad_ess, grad_log_weights,
         samples, mix_weights, mix_mus, mix_stds, q_mu, q_std,
         weighted_mean, log_weights),
    )


@torch.library.register_fake("fused_ops::importance_sampling_backward")
def _importance_sampling_backward_fake(
    grad_weighted_mean, grad_ess, grad_log_weights,
    samples, mix_weights, mix_mus, mix_stds, q_mu, q_std,
    weighted_mean, log_weights,
):
    torch._check(samples.dim() == 2, lambda: f"samples must be a 2-D tensor [N, D], got {samples.shape}")
    return tuple(t.new_empty(t.shape) for t in (samples, mix_weights, mix_mus, mix_stds, q_mu, q_std))


_forbid_double_backward("importance_sampling", "fused_ops.reference.importance_sampling")


_register_autograd(
    torch.ops.fused_ops.importance_sampling.default,
    _importance_sampling_backward,
    _importance_sampling_setup_context,
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
    the same inputs on the same device (on the CPU also for the same
    alignment of the weights in memory: the BLAS rounds differently for a
    weight tensor that does not start on a 64-byte boundary).  ``dt`` and
    ``t`` are rounded from double to the tensors' dtype, as
    ``torch.tensor(1.0 / num_steps)`` rounds the reference module's ``dt``
    buffer in float32.

    Differentiable with respect to every tensor input through the fused
    :func:`flow_euler_backward` op, which recomputes the trajectory from
    ``x0`` and runs the steps in reverse (memory: ``O(num_steps * B * D)``
    plus ``O(B * H)``, or ``O(num_steps * B * H)`` for small problems; see
    there).  Double backward and forward-mode AD (``torch.func.jvp``, dual
    tensors) are not supported (clear errors).
    """
    return _call_op(torch.ops.fused_ops.flow_euler.default, (x0, w1, b1, w2, b2, w3, b3), num_steps)


@torch.library.register_fake("fused_ops::flow_euler")
def _flow_euler_fake(x0, w1, b1, w2, b2, w3, b3, num_steps):
    torch._check(x0.dim() == 2, lambda: f"x0 must be a 2-D tensor [B, D], got {x0.shape}")
    torch._check(num_steps >= 1, lambda: f"num_steps must be at least 1, got {num_steps}")
    b, d = x0.shape
    return x0.new_empty((b, d))  # contiguous, like the kernels' output


def _flow_euler_setup_context(ctx, inputs, output):
    *tensors, num_steps = inputs
    ctx.num_steps = num_steps
    ctx.save_for_backward(*tensors)  # the inputs only: the backward recomputes the trajectory


def flow_euler_backward(
    grad_x: Tensor,
    x0: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    w3: Tensor,
    b3: Tensor,
    num_steps: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    r"""Fused backward of :func:`flow_euler` (the discrete adjoint through all
    Euler steps): given ``grad_x = dL/dx [B, D]`` and the forward's inputs,
    returns ``(grad_x0, grad_w1, grad_b1, grad_w2, grad_b2, grad_w3, grad_b3)``,
    each contiguous with its input's shape.

    The trajectory ``x_0 .. x_{num_steps-1}`` is recomputed from ``x0``, then
    the steps run in reverse (``t_k = (k+0.5)/num_steps``, ``h1, h2`` and
    ``silu'(a1), silu'(a2)`` the hidden layers of step ``k`` at state ``x_k``)::

        g_v = dt * g;                gw3 += g_v^T h2;  gb3 += sum_rows g_v
        g_a2 = (g_v @ w3) * silu'(a2);  gw2 += g_a2^T h1;  gb2 += sum_rows g_a2
        g_a1 = (g_a2 @ w2) * silu'(a1); gw1 += g_a1^T [x_k, t_k];  gb1 += sum_rows g_a1
        g = g + g_a1 @ w1[:, :D]     # dL/dx_k; grad_x0 = g after step 0

    Two modes, picked from the sizes (memory in elements of the dtype, besides
    the outputs; n = num_steps):

    - resident (``n*B <= 512`` and ``6*n*B*H <= 4 Mi``, e.g. the default B=8,
      D=64, H=256, 32 steps): the trajectory pass keeps every step's hidden
      layers, nothing is recomputed, and each weight gradient is one product
      over all ``n*B`` rows.  Memory ``6*n*B*H + 2*n*B*D + 3*B*D`` (about
      1.7 MB in float32 at the default size).
    - streaming (otherwise): only the trajectory is kept and each reverse step
      recomputes its hidden layers from ``x_k``.  Memory ``(n-1)*B*D`` for the
      trajectory plus ``6*B*H + 4*B*D + 2*H*D + H*H`` that do not grow with
      ``n`` (62 MB in float32 at B=4096, D=64, H=256, 32 steps).

    CUDA, resident: one cooperative launch, the whole sequence as grid-
    synchronised phases of FMA product tiles with the elementwise work in
    their epilogues (plain float32/float64 arithmetic, never TF32).
    Otherwise products run as BLAS (CPU) or cuBLAS (CUDA, torch's current
    stream) calls over all rows, with fused epilogue kernels (bias/SiLU/SiLU',
    Euler update, gradient products with deterministic column sums) between
    them; there the CUDA float32 products follow
    ``torch.backends.cuda.matmul.allow_tf32``.  Results are bitwise
    reproducible for the same inputs on the same device.
    Not differentiable itself: double backward raises an error.
    """
    return _call_op(torch.ops.fused_ops.flow_euler_backward.default, (grad_x, x0, w1, b1, w2, b2, w3, b3), num_steps)


@torch.library.register_fake("fused_ops::flow_euler_backward")
def _flow_euler_backward_fake(grad_x, x0, w1, b1, w2, b2, w3, b3, num_steps):
    torch._check(x0.dim() == 2, lambda: f"x0 must be a 2-D tensor [B, D], got {x0.shape}")
    torch._check(
        grad_x.shape == x0.shape, lambda: f"grad_x must have the shape of x0 {x0.shape}, got {grad_x.shape}"
    )
    torch._check(num_steps >= 1, lambda: f"num_steps must be at least 1, got {num_steps}")
    return tuple(t.new_empty(t.shape) for t in (x0, w1, b1, w2, b2, w3, b3))


_forbid_double_backward("flow_euler", "fused_ops.reference.flow_euler")


def _flow_euler_backward(ctx, grad_x):
    x0, w1, b1, w2, b2, w3, b3 = ctx.saved_tensors
    grads = _call_op(
        torch.ops.fused_ops.flow_euler_backward.default, (grad_x, x0, w1, b1, w2, b2, w3, b3), ctx.num_steps
    )
    return (*grads, None)


_register_autograd(torch.ops.fused_ops.flow_euler.default, _flow_euler_backward, _flow_euler_setup_context)


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
    In float32 each term is computed from one exp and one log (the logs of
    ``p`` and ``1 - p`` as softplus terms) with float32 ``p``'s saturation,
    and above a logit of 4 its rounding in ``log1p(-p)``, kept
    (``csrc/common/bce.h``).

    Returns ``(elbo [B], recon [B], kl [B])``.  Neither the hidden activations
    nor the reconstruction are materialised.  Results are bitwise reproducible
    for the same inputs on the same device.

    Differentiable with respect to every input.  On CUDA (and for
    ``torch.ops.fused_ops.vae_elbo`` called directly) only the inputs are
    saved and the fused backward op ``fused_ops::vae_elbo_backward`` recomputes
    h, mu, logvar, z, the decoder hidden layer and p (see
    :func:`_vae_elbo_backward`).  On the CPU, where the products are
    BLAS-bound and recomputing them would cost as much as the forward, a call
    that needs gradients goes through ``fused_ops::vae_elbo_train`` instead,
    which keeps those activations (``B * (2H + 3L + I)`` elements) for
    ``fused_ops::vae_elbo_train_backward``; the results are the same.  Double
    backward and forward-mode AD (``torch.func.jvp``, dual tensors) are not
    supported (RuntimeErrors).
    """
    args = (x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2)
    if x.is_cpu and _needs_grad(args):
        if not torch.compiler.is_compiling():
            _reject_forward_ad(torch.ops.fused_ops.vae_elbo.default, args)  # names the public op
        elbo, recon, kl, _ = _call_op(torch.ops.fused_ops.vae_elbo_train.default, args)
        return elbo, recon, kl
    return _call_op(torch.ops.fused_ops.vae_elbo.default, args)


@torch.library.register_fake("fused_ops::vae_elbo")
def _vae_elbo_fake(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2):
    torch._check(x.dim() == 2, lambda: f"x must be a 2-D tensor [B, I], got {x.shape}")
    torch._check(eps.dim() == 2, lambda: f"eps must be a 2-D tensor [B, L], got {eps.shape}")
    torch._check(eps.shape[0] == x.shape[0], lambda: f"eps.shape[0] must be B={x.shape[0]}, got {eps.shape}")
    b = x.shape[0]
    return x.new_empty(b), x.new_empty(b), x.new_empty(b)


def _vae_elbo_setup_context(ctx, inputs, output):
    # Saves the 12 inputs only -- no activations: the backward op recomputes
    # h, mu, logvar, z, the decoder hidden layer and p (on CUDA one extra
    # forward's products, cheaper than keeping B * (2H + 3L + I) activations
    # alive between forward and backward; CPU calls that need gradients go
    # through vae_elbo_train, which keeps them, see vae_elbo).  An unused
    # output's gradient stays None (the backward op reads it as zero) rather
    # than a zero tensor autograd would allocate and fill.
    ctx.save_for_backward(*inputs)
    ctx.set_materialize_grads(False)


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
    CUDA, up to ~1.5e9 multiply-adds (``B H (6 I + 8 L)``; B ~ 1000 at
    784-256-32): one cooperative launch, the chain above as nine
    grid-synchronised phases of 32 x 32 FMA tiles with the elementwise work
    in their epilogues; larger: 13 cuBLAS products and 9 small kernels
    (elementwise epilogues, all bias gradients in one fixed-order column-sum
    launch).  No atomics anywhere: both devices are deterministic.
    """
    return _call_op(
        torch.ops.fused_ops.vae_elbo_backward.default, (grad_elbo, grad_recon, grad_kl, *ctx.saved_tensors)
    )


@torch.library.register_fake("fused_ops::vae_elbo_backward")
def _vae_elbo_backward_fake(grad_elbo, grad_recon, grad_kl, *inputs):
    return tuple(t.new_empty(t.shape) for t in inputs)


# The CPU training pair: vae_elbo_train is vae_elbo plus the activations its
# backward reads (csrc/vae_elbo.h, VaeSavedLayout), vae_elbo_train_backward
# reads them instead of recomputing the forward.


def _vae_saved_numel(x, w_enc, w_mu):
    (b, i), h, l_ = x.shape, w_enc.shape[0], w_mu.shape[0]
    return b * (2 * h + 3 * l_ + i)


@torch.library.register_fake("fused_ops::vae_elbo_train")
def _vae_elbo_train_fake(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2):
    elbo, recon, kl = _vae_elbo_fake(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1,
                                     w_dec2, b_dec2)
    return elbo, recon, kl, x.new_empty(_vae_saved_numel(x, w_enc, w_mu))


def _vae_elbo_train_setup_context(ctx, inputs, output):
    # The inputs and the saved activations (not the losses).  Unused outputs'
    # gradients stay None, in particular the saved buffer's, which autograd
    # would otherwise fill with B * (2H + 3L + I) zeros every backward.
    ctx.save_for_backward(*inputs, output[3])
    ctx.set_materialize_grads(False)


def _vae_elbo_train_backward(ctx, grad_elbo, grad_recon, grad_kl, _grad_saved):
    r"""Backward of ``fused_ops::vae_elbo_train`` (CPU): the math of
    :func:`_vae_elbo_backward`, with h, mu/logvar, z, the decoder hidden layer
    and the logits read from the saved buffer instead of recomputed, and
    ``grad_x`` (with its ``[B, H] x [H, I]`` product) computed only when x
    requires grad.  Memory: the saved buffer, ``B * (2H + 3L + I)``
    elements (784-256-32 at B=128 in float32: 0.7 MB), alive from forward to
    backward."""
    *inputs, saved = ctx.saved_tensors
    grads = _call_op(
        torch.ops.fused_ops.vae_elbo_train_backward.default,
        (grad_elbo, grad_recon, grad_kl, *inputs, saved),
        ctx.needs_input_grad[0],
    )
    return (grads[0] if ctx.needs_input_grad[0] else None, *grads[1:])


@torch.library.register_fake("fused_ops::vae_elbo_train_backward")
def _vae_elbo_train_backward_fake(grad_elbo, grad_recon, grad_kl, *inputs_saved_flag):
    *inputs, _saved, compute_grad_x = inputs_saved_flag
    grad_x = inputs[0].new_empty(inputs[0].shape if compute_grad_x else (0,))
    return (grad_x, *(t.new_empty(t.shape) for t in inputs[1:]))


_forbid_double_backward("vae_elbo_train", "fused_ops.reference.VAE")

_register_autograd(
    torch.ops.fused_ops.vae_elbo_train.default, _vae_elbo_train_backward, _vae_elbo_train_setup_context
)


_register_autograd(torch.ops.fused_ops.vae_elbo.default, _vae_elbo_backward, _vae_elbo_setup_context)
_forbid_double_backward("vae_elbo", "fused_ops.reference.VAE")
