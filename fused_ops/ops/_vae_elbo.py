"""``fused_ops.vae_elbo``: the forward pass of a one-hidden-layer VAE with
reparameterisation, BCE reconstruction and KL, as per-sample ELBO terms.

The function, the fake (meta) implementations and autograd registrations of
its ops: ``vae_elbo`` with its fused backward ``vae_elbo_backward`` (which
recomputes the activations), and the training pair ``vae_elbo_train`` /
``vae_elbo_train_backward`` (which keeps them).  The kernels are registered
from C++ (``csrc/cuda/vae_elbo/``, ``csrc/cpu/vae_elbo/``).
"""

import math

import torch
from torch import Tensor

from .. import _eager, _paths
from . import _dtypes
from ._checks import check, check_rank, check_same_float_dtype_and_device, check_size, shape_str

__all__ = ["vae_elbo", "LIKELIHOODS"]

#: The reconstruction likelihoods, by name, with the op's ``likelihood``
#: code (csrc/common/likelihood.h): the PyTorch expression each replaces is
#: in :func:`vae_elbo`'s docstring.
LIKELIHOODS = {"bernoulli": 0, "bernoulli_logits": 1, "gaussian_sigmoid": 2, "gaussian": 3}

_OP = torch.ops.fused_ops.vae_elbo.default
_BACKWARD_OP = torch.ops.fused_ops.vae_elbo_backward.default
_TRAIN_OP = torch.ops.fused_ops.vae_elbo_train.default
_TRAIN_BACKWARD_OP = torch.ops.fused_ops.vae_elbo_train_backward.default


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
    *,
    likelihood: str = "bernoulli",
    return_outputs: bool = False,
    dec_logvar: Tensor | None = None,
) -> tuple[Tensor, ...]:
    r"""Forward pass of a one-hidden-layer VAE with reparameterisation, BCE
    reconstruction loss and KL term, in one fused kernel.

    Shapes: ``x [B, I]`` (values in [0, 1]), ``eps [B, L]``, ``w_enc [H, I]``,
    ``b_enc [H]``, ``w_mu [L, H]``, ``b_mu [L]``, ``w_logvar [L, H]``,
    ``b_logvar [L]``, ``w_dec1 [H, L]``, ``b_dec1 [H]``, ``w_dec2 [I, H]``,
    ``b_dec2 [I]`` (``nn.Linear`` weight layout); all float32 or all float64,
    on one device (CPU or CUDA).

    Dtypes: all float32, all float64 or all bfloat16 (the op's rule); this
    function also takes all-float16 inputs, computes in float32 and returns
    its outputs in the inputs' dtype (gradients too).  bfloat16 goes to the
    op as it is: on CUDA at B >= 2048 (Bernoulli, H % 16 == 0, H <= 256) the
    ``tiled_bf16`` path (bfloat16 tensor-core products with float32
    accumulation, the rest float32), otherwise the float32 kernels on
    float32 copies; outputs and gradients in bfloat16.  Under ``torch.autocast`` (CPU, CUDA)
    lower-precision and float32 inputs run in float32 and the outputs are
    float32; float64 inputs stay float64 (``fused_ops/ops/_dtypes.py``).

    The targets ``x`` must be probabilities.  On the CPU a target outside
    [0, 1] or NaN raises a RuntimeError naming ``x`` and the first such
    element, as ``binary_cross_entropy`` raises for its target (checked in
    the kernel's BCE loop, at no extra pass over ``x``).  On CUDA, where a
    raise would cost a host synchronisation per call, such a row's ``recon``
    and ``elbo`` are NaN (and so are the gradients that depend on them);
    the other rows are unaffected.  NaN anywhere in the inputs propagates as
    in the reference's autograd: the ReLU backward passes the gradient where
    the activation is NaN.

    Math (exactly ``fused_ops.reference.VAE``)::

        h      = relu(x @ w_enc.T + b_enc)
        mu     = h @ w_mu.T + b_mu ;  logvar = h @ w_logvar.T + b_logvar
        z      = mu + exp(0.5 * logvar) * eps
        p      = sigmoid(relu(z @ w_dec1.T + b_dec1) @ w_dec2.T + b_dec2)   # 1/(1+exp(-a))
        recon  = sum_i( (x-1) * max(log1p(-p), -100) - x * max(log(p), -100) )  # PyTorch's BCE
        kl     = -0.5 * sum_l( 1 + logvar - mu**2 - exp(logvar) )
        elbo   = -(recon + kl)

    ``likelihood`` picks the reconstruction term, with ``a`` the decoder's
    last Linear's output (logits) and each term summed over the features,
    exactly the PyTorch expression it replaces (per sample)::

        "bernoulli"         F.binary_cross_entropy(torch.sigmoid(a), x, reduction="none").sum(-1)
        "bernoulli_logits"  F.binary_cross_entropy_with_logits(a, x, reduction="none").sum(-1)
        "gaussian_sigmoid"  F.mse_loss(torch.sigmoid(a), x, reduction="none").sum(-1)
        "gaussian"          F.mse_loss(a, x, reduction="none").sum(-1)

    With ``likelihood="gaussian"``, ``dec_logvar [I]`` (a learned
    per-dimension log-variance of the decoder, differentiable) makes the term
    the Gaussian negative log-likelihood
    ``-Normal(a, exp(0.5 * dec_logvar)).log_prob(x).sum(-1)`` =
    ``0.5 * sum_i((a_i - x_i)**2 exp(-dec_logvar_i) + dec_logvar_i + log(2 pi))``.
    The op computes it as the "gaussian" term of ``a`` and ``x`` both scaled
    by ``c = exp(-0.5 * dec_logvar)``, halved, plus the constant part: the
    last Linear's weight rows and bias and the targets are multiplied by c,
    the encoder's weight columns by 1 / c so that its products see x
    unchanged (PyTorch products, ``B I + 2 I H`` multiplications; the
    encoder's inputs round differently, by a few ulps).  Gradients reach
    ``dec_logvar`` through those scalings.

    "bernoulli" (the default) is the formula above.  The Gaussian terms are
    the ``mse_loss(recon_x, x, reduction="sum")`` Gaussian VAEs write: a
    Gaussian of fixed variance without its constants (another fixed sigma
    scales the term: weight ``recon`` yourself); "gaussian_sigmoid" is for a
    decoder ending in a Sigmoid (images in [0, 1]), "gaussian" for one ending
    in its Linear.  The targets' range is checked (CPU) only for
    "bernoulli", as ``binary_cross_entropy`` checks it.  Other likelihoods
    run on the CPU and, on CUDA, on the cublas path at B >= 2048 and the
    general path below (the tensor-core and cluster paths compute the
    Bernoulli term only): a small Gaussian batch on CUDA is correct but
    slower.

    The clamp at -100 is PyTorch's ``binary_cross_entropy``'s: once the logit
    passes ~17, ``p`` rounds to exactly 1.0 in float32 and the clamp applies.
    In float32 each term is computed from one exp and one log (the logs of
    ``p`` and ``1 - p`` as softplus terms) with float32 ``p``'s saturation,
    and above a logit of 4 its rounding in ``log1p(-p)``, kept
    (``csrc/common/bce.h``).

    Returns ``(elbo [B], recon [B], kl [B])``.  Neither the hidden activations
    nor the reconstruction are materialised.  Results are bitwise reproducible
    for the same inputs on the same device.

    With ``return_outputs=True`` it returns ``(elbo, recon, kl, recon_x [B, I],
    mu [B, L], logvar [B, L])``: the decoder's output -- ``torch.sigmoid(a)``
    (probabilities, or the Gaussian mean for "gaussian_sigmoid"), ``a`` itself
    for "gaussian" -- and the latent heads, for the images,
    latents and monitoring users plot.  They carry no gradient (detached);
    gradients flow through ``elbo``, ``recon`` and ``kl`` as without them.
    They are the activations the training op ``vae_elbo_train`` keeps for
    its backward (on CUDA at large batches the wgmma kernel stores them as
    it forms them), except for a small CUDA batch that needs gradients,
    whose one-launch backward saves nothing: there PyTorch computes them from
    the same weights (the encoder and decoder products once more; equal to
    the kernel's to float32 rounding).

    On CUDA the kernel is one of several paths, picked from the sizes (and
    the build's architectures) by the op's dispatch table:
    ``fused_ops._paths.table("vae_elbo")`` lists them with their conditions.

    Differentiable with respect to every input.  Two routes, the same
    results: a call that needs gradients on the CPU, or on CUDA at batches
    where the backward would run cuBLAS products (``B H (6 I + 8 L)`` above
    1.5e9 multiply-adds: B > 1181 at 784-256-32), goes through
    ``fused_ops::vae_elbo_train``, which keeps h, mu, logvar, z, the decoder
    hidden layer and the logits (``B * (2H + 3L + I)`` elements: 20 MB at
    B=8192, 784-256-32, float32) for ``fused_ops::vae_elbo_train_backward``,
    which then runs no forward products and skips x's gradient when x needs
    none.  Other calls (and ``torch.ops.fused_ops.vae_elbo`` called directly)
    save only the inputs, and ``fused_ops::vae_elbo_backward`` recomputes the
    activations (on CUDA one cooperative launch at small batches, see
    :func:`_vae_elbo_backward`).  Double backward and forward-mode AD
    (``torch.func.jvp``, dual tensors) are not supported (RuntimeErrors).

    Graphs: a graph recorded to run elsewhere -- ``torch.export`` (and
    AOTInductor, which builds on it) and ``torch.jit.trace`` -- records
    ``fused_ops::vae_elbo`` with its registered autograd, whose route does
    not depend on the device or batch it was recorded at.
    ``torch.compile`` keeps the training pair: its graphs are specialised
    to the device and sizes they were compiled for.
    """
    inputs = (x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2)
    # The default likelihood is the schema's default: no scalar to box.
    scalars = () if likelihood == "bernoulli" else (likelihood_code(likelihood),)
    if _bfloat16_to_the_op(inputs, dec_logvar, return_outputs):
        # The op takes bfloat16 itself (CUDA: the bfloat16 tensor-core path
        # at large batches, else a float32 run on float32 copies; the CPU:
        # the latter), its gradients through the same cast.
        return _eager.call(_OP, inputs, *scalars)
    args, out_dtype = _dtypes.to_compute_dtype(_ARG_NAMES, inputs)
    if dec_logvar is not None:
        if args[0] is not x and isinstance(dec_logvar, Tensor):  # cast to the compute dtype with the rest
            dec_logvar = dec_logvar.to(args[0].dtype)
        return _dtypes.from_compute_dtype(_learned_variance(args, scalars, dec_logvar, return_outputs), out_dtype)
    if return_outputs:
        return _dtypes.from_compute_dtype(_with_outputs(args, scalars), out_dtype)
    # x None: the op's checks name x.
    if x is not None and _keeps_activations(args) and _eager.needs_grad(args) and not _recording_a_portable_graph():
        if not torch.compiler.is_compiling():
            _eager.reject_forward_ad(_OP, args)  # names the public op
        elbo, recon, kl, _ = _eager.call(_TRAIN_OP, args, *scalars)
        return _dtypes.from_compute_dtype((elbo, recon, kl), out_dtype)
    return _dtypes.from_compute_dtype(_eager.call(_OP, args, *scalars), out_dtype)


def _bfloat16_to_the_op(inputs, dec_logvar, return_outputs):
    """Whether a call goes to the op with its bfloat16 inputs as they are:
    every input bfloat16, outside autocast, without ``dec_logvar`` or
    ``return_outputs``, and not a CPU call that needs gradients (those run
    the float32 CPU training pair, on casts made here)."""
    x = inputs[0]
    if not isinstance(x, Tensor) or x.dtype != torch.bfloat16 or dec_logvar is not None or return_outputs:
        return False
    if _dtypes.autocast_on(x.device.type):  # autocast's float32 rule
        return False
    if not all(isinstance(t, Tensor) and t.dtype == torch.bfloat16 for t in inputs):
        return False  # to_compute_dtype names the mismatched argument
    return not (x.is_cpu and _eager.needs_grad(inputs) and not _recording_a_portable_graph())


_ARG_NAMES = ("x", "eps", "w_enc", "b_enc", "w_mu", "b_mu", "w_logvar", "b_logvar", "w_dec1", "b_dec1", "w_dec2",
              "b_dec2")


def likelihood_code(name):
    """The op's ``likelihood`` code of a :data:`LIKELIHOODS` name."""
    code = LIKELIHOODS.get(name) if isinstance(name, str) else None
    if code is None:
        raise ValueError(f"likelihood must be one of {', '.join(map(repr, LIKELIHOODS))}, got {name!r}")
    return code


def _learned_variance(args, scalars, dec_logvar, return_outputs):
    """The Gaussian with a learned per-dimension log-variance (see
    :func:`vae_elbo`): the "gaussian" op on scaled logits and targets."""
    x, w_dec2, b_dec2 = args[0], args[10], args[11]
    if scalars != (LIKELIHOODS["gaussian"],):
        raise ValueError("dec_logvar (a learned per-dimension log-variance) needs likelihood='gaussian'")
    if not isinstance(dec_logvar, Tensor) or dec_logvar.dim() != 1 or x is None or x.dim() != 2 \
            or dec_logvar.shape[0] != x.shape[1]:
        got = list(dec_logvar.shape) if isinstance(dec_logvar, Tensor) else type(dec_logvar).__name__
        raise ValueError(f"dec_logvar must be a 1-D tensor [I] (I = x.shape[1]), got {got}")
    if dec_logvar.dtype != x.dtype or dec_logvar.device != x.device:
        raise ValueError(f"dec_logvar must have x's dtype and device ({x.dtype}, {x.device}), "
                         f"got {dec_logvar.dtype}, {dec_logvar.device}")
    inv_sd = torch.exp(-0.5 * dec_logvar)
    # x is the encoder's input and the targets: the encoder's columns undo its scaling.
    scaled = (x * inv_sd, args[1], args[2] * torch.exp(0.5 * dec_logvar), *args[3:10],
              w_dec2 * inv_sd[:, None], b_dec2 * inv_sd)
    out = _with_outputs(scaled, scalars) if return_outputs else _eager.call(_OP, scaled, *scalars)
    elbo, recon, kl = out[:3]
    recon = 0.5 * recon + 0.5 * (dec_logvar.sum() + x.shape[1] * math.log(2 * math.pi))
    if not return_outputs:
        return -(recon + kl), recon, kl
    return (-(recon + kl), recon, kl, out[3] / inv_sd.detach(), *out[4:])


def _with_outputs(args, scalars):
    """``vae_elbo(*args, return_outputs=True)``: the losses, then ``recon_x``,
    ``mu``, ``logvar`` (detached)."""
    mean = (lambda a: a) if scalars == (LIKELIHOODS["gaussian"],) else torch.sigmoid
    x = args[0]
    # The training op's saved activations are the outputs, wherever it is
    # the route (or no backward follows); a small CUDA batch that needs
    # gradients keeps the one-launch backward and gets them from PyTorch.
    train_op = isinstance(x, Tensor) and (_keeps_activations(args) or not _eager.needs_grad(args))
    if train_op and not _recording_a_portable_graph():
        if not torch.compiler.is_compiling():
            _eager.reject_forward_ad(_OP, args)
        elbo, recon, kl, saved = _eager.call(_TRAIN_OP, args, *scalars)
        b, i, h, l_ = x.shape[0], x.shape[1], args[2].shape[0], args[4].shape[0]
        saved = saved.detach()
        # csrc/vae_elbo.h's VaeSavedLayout: h [B, H] | ml [B, 2L] | z [B, L] | g [B, H] | logits [B, I].
        ml = saved[b * h:b * (h + 2 * l_)].view(b, 2 * l_)
        logits = saved[b * (2 * h + 3 * l_):].view(b, i)
        return elbo, recon, kl, mean(logits), ml[:, :l_].contiguous(), ml[:, l_:].contiguous()
    elbo, recon, kl = _eager.call(_OP, args, *scalars)
    x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2 = (
        t.detach() for t in args)
    linear = torch.nn.functional.linear
    h = torch.relu(linear(x, w_enc, b_enc))
    mu, logvar = linear(h, w_mu, b_mu), linear(h, w_logvar, b_logvar)
    z = mu + torch.exp(0.5 * logvar) * eps
    recon_x = mean(linear(torch.relu(linear(z, w_dec1, b_dec1)), w_dec2, b_dec2))
    return elbo, recon, kl, recon_x, mu, logvar


# csrc/cuda/vae_elbo/backward_paths.cuh's kPersistentMaxMacs: above it
# vae_elbo_backward takes its cuBLAS path, whose forward products the
# training pair saves.
_PERSISTENT_MAX_MACS = 1.5e9


def _keeps_activations(args) -> bool:
    """Whether a call that needs gradients takes the training pair
    (``vae_elbo_train``, which keeps the activations): every CPU call; a
    CUDA call where ``vae_elbo_backward`` would recompute the forward with
    cuBLAS products (``B H (6 I + 8 L)`` above 1.5e9 multiply-adds, B > 1181
    at 784-256-32) and no ``vae_elbo`` or ``vae_elbo_backward`` path is
    forced (``fused_ops._paths``: the forced kernel then runs).  Below, the
    one-launch backward recomputes the forward faster than a saved buffer
    would be written and read."""
    x, w_enc, w_mu = args[0], args[2], args[4]
    if not isinstance(x, Tensor) or x.is_cpu:
        return isinstance(x, Tensor)
    if not (x.is_cuda and x.dim() == 2 and isinstance(w_enc, Tensor) and w_enc.dim() == 2
            and isinstance(w_mu, Tensor) and w_mu.dim() == 2):
        return False  # the op's checks name what is wrong
    if _paths.forced("vae_elbo") or _paths.forced("vae_elbo_backward"):
        return False
    (b, i), h, l_ = x.shape, w_enc.shape[0], w_mu.shape[0]
    return b * h * (6 * i + 8 * l_) > _PERSISTENT_MAX_MACS


def _recording_a_portable_graph() -> bool:
    """Whether this call is being recorded into a graph that may later run
    on another device (torch.export, torch.jit.trace), which must then hold
    the portable ``vae_elbo`` rather than the training pair, whose route
    depends on the device and the batch."""
    return torch.compiler.is_exporting() or torch.jit.is_tracing()


def _check_args(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2,
                allow_bfloat16=False):
    """The argument rules of csrc/vae_elbo.h's check_vae_elbo_args, in its
    order and with its messages (fused_ops/ops/_checks.py); returns ``(B, I, H, L)``.
    ``allow_bfloat16``: ``vae_elbo`` and ``vae_elbo_backward`` take all-bfloat16
    inputs (not the training pair)."""
    check_rank(x, "x", 2, "[B, I]")
    check_rank(eps, "eps", 2, "[B, L]")
    check_rank(w_enc, "w_enc", 2, "[H, I]")
    check_rank(b_enc, "b_enc", 1, "[H]")
    check_rank(w_mu, "w_mu", 2, "[L, H]")
    check_rank(b_mu, "b_mu", 1, "[L]")
    check_rank(w_logvar, "w_logvar", 2, "[L, H]")
    check_rank(b_logvar, "b_logvar", 1, "[L]")
    check_rank(w_dec1, "w_dec1", 2, "[H, L]")
    check_rank(b_dec1, "b_dec1", 1, "[H]")
    check_rank(w_dec2, "w_dec2", 2, "[I, H]")
    check_rank(b_dec2, "b_dec2", 1, "[I]")
    (b, i), h, l_ = x.shape, w_enc.shape[0], w_mu.shape[0]
    check(i >= 1, "x must have at least one feature (I >= 1), got shape ", shape_str(x))
    check(h >= 1, "w_enc must have at least one hidden unit (H >= 1), got shape ", shape_str(w_enc))
    check(l_ >= 1, "w_mu must have at least one latent unit (L >= 1), got shape ", shape_str(w_mu))
    check_size(w_enc, "w_enc", 1, i, "I, the input dimension of x")
    check_size(b_enc, "b_enc", 0, h, "H, the hidden dimension of w_enc")
    check_size(w_mu, "w_mu", 1, h, "H, the hidden dimension of w_enc")
    check_size(b_mu, "b_mu", 0, l_, "L, the latent dimension of w_mu")
    check_size(w_logvar, "w_logvar", 0, l_, "L, the latent dimension of w_mu")
    check_size(w_logvar, "w_logvar", 1, h, "H, the hidden dimension of w_enc")
    check_size(b_logvar, "b_logvar", 0, l_, "L, the latent dimension of w_mu")
    check_size(eps, "eps", 0, b, "B, the batch size of x")
    check_size(eps, "eps", 1, l_, "L, the latent dimension of w_mu")
    check_size(w_dec1, "w_dec1", 0, h, "H, the hidden dimension of w_enc")
    check_size(w_dec1, "w_dec1", 1, l_, "L, the latent dimension of w_mu")
    check_size(b_dec1, "b_dec1", 0, h, "H, the hidden dimension of w_enc")
    check_size(w_dec2, "w_dec2", 0, i, "I, the input dimension of x")
    check_size(w_dec2, "w_dec2", 1, h, "H, the hidden dimension of w_enc")
    check_size(b_dec2, "b_dec2", 0, i, "I, the input dimension of x")
    check_same_float_dtype_and_device([
        (x, "x"), (eps, "eps"), (w_enc, "w_enc"), (b_enc, "b_enc"), (w_mu, "w_mu"), (b_mu, "b_mu"),
        (w_logvar, "w_logvar"), (b_logvar, "b_logvar"), (w_dec1, "w_dec1"), (b_dec1, "b_dec1"),
        (w_dec2, "w_dec2"), (b_dec2, "b_dec2"),
    ], allow_bfloat16)
    return b, i, h, l_


def _check_likelihood(likelihood):
    """csrc/vae_elbo.h's check_vae_likelihood (the likelihood code, after the tensors)."""
    check(0 <= likelihood < len(LIKELIHOODS), "likelihood must be 0 (Bernoulli), 1 (Bernoulli from logits), ",
          "2 (Gaussian, mean sigmoid(logits)) or 3 (Gaussian, mean = logits), got ", likelihood)


def _check_backward_args(grad_elbo, grad_recon, grad_kl, *inputs, allow_bfloat16=False):
    """The rules of csrc/vae_elbo_backward.h's VaeElboBackwardCall; returns ``(B, I, H, L)``."""
    sizes = _check_args(*inputs, allow_bfloat16=allow_bfloat16)
    for g, name in ((grad_elbo, "grad_elbo"), (grad_recon, "grad_recon"), (grad_kl, "grad_kl")):
        if g is not None:
            check_rank(g, name, 1, "[B]")
            check_size(g, name, 0, sizes[0], "B, the batch size of x")
            check_same_float_dtype_and_device([(inputs[0], "x"), (g, name)], allow_bfloat16)
    return sizes


@torch.library.register_fake("fused_ops::vae_elbo")
def _vae_elbo_fake(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2,
                   likelihood=0):
    b = _check_args(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2,
                    allow_bfloat16=True)[0]
    _check_likelihood(likelihood)
    return x.new_empty(b), x.new_empty(b), x.new_empty(b)  # in the inputs' dtype, bfloat16 included


# Autograd: the fused backward ops, themselves not differentiable.


def _vae_elbo_setup_context(ctx, inputs, output):
    # Saves the 12 inputs only -- no activations: the backward op recomputes
    # h, mu, logvar, z, the decoder hidden layer and p (on CUDA one extra
    # forward's products, cheaper than keeping B * (2H + 3L + I) activations
    # alive between forward and backward; CPU calls that need gradients go
    # through vae_elbo_train, which keeps them, see vae_elbo).  An unused
    # output's gradient stays None (the backward op reads it as zero) rather
    # than a zero tensor autograd would allocate and fill.
    ctx.save_for_backward(*inputs[:12])
    ctx.scalars = tuple(inputs[12:])  # the likelihood code, when passed
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
    grads = _eager.call(_BACKWARD_OP, (grad_elbo, grad_recon, grad_kl, *ctx.saved_tensors), *ctx.scalars)
    return (*grads, *(None for _ in ctx.scalars))


@torch.library.register_fake("fused_ops::vae_elbo_backward")
def _vae_elbo_backward_fake(grad_elbo, grad_recon, grad_kl, *inputs_likelihood):
    inputs, likelihood = inputs_likelihood[:12], (inputs_likelihood[12:] or (0,))[0]
    _check_backward_args(grad_elbo, grad_recon, grad_kl, *inputs, allow_bfloat16=True)
    _check_likelihood(likelihood)
    return tuple(t.new_empty(t.shape) for t in inputs)


# The training pair: vae_elbo_train is vae_elbo plus the activations its
# backward reads (csrc/vae_elbo.h, VaeSavedLayout), vae_elbo_train_backward
# reads them instead of recomputing the forward.


def _vae_saved_numel(b, i, h, l_):
    return b * (2 * h + 3 * l_ + i)


@torch.library.register_fake("fused_ops::vae_elbo_train")
def _vae_elbo_train_fake(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2,
                         likelihood=0):
    sizes = _check_args(x, eps, w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2)
    _check_likelihood(likelihood)
    b = sizes[0]
    return x.new_empty(b), x.new_empty(b), x.new_empty(b), x.new_empty(_vae_saved_numel(*sizes))


def _vae_elbo_train_setup_context(ctx, inputs, output):
    # The inputs and the saved activations (not the losses).  Unused outputs'
    # gradients stay None, in particular the saved buffer's, which autograd
    # would otherwise fill with B * (2H + 3L + I) zeros every backward.
    ctx.save_for_backward(*inputs[:12], output[3])
    ctx.scalars = tuple(inputs[12:])  # the likelihood code, when passed
    ctx.set_materialize_grads(False)


def _vae_elbo_train_backward(ctx, grad_elbo, grad_recon, grad_kl, _grad_saved):
    r"""Backward of ``fused_ops::vae_elbo_train``: the math of
    :func:`_vae_elbo_backward`, with h, mu/logvar, z, the decoder hidden layer
    and the logits read from the saved buffer instead of recomputed, and
    ``grad_x`` (with its ``[B, H] x [H, I]`` product) computed only when x
    requires grad.  Memory: the saved buffer, ``B * (2H + 3L + I)``
    elements (784-256-32 at B=128 in float32: 0.7 MB), alive from forward to
    backward."""
    *inputs, saved = ctx.saved_tensors
    grads = _eager.call(
        _TRAIN_BACKWARD_OP,
        (grad_elbo, grad_recon, grad_kl, *inputs, saved),
        ctx.needs_input_grad[0],
        *ctx.scalars,
    )
    return (grads[0] if ctx.needs_input_grad[0] else None, *grads[1:], *(None for _ in ctx.scalars))


@torch.library.register_fake("fused_ops::vae_elbo_train_backward")
def _vae_elbo_train_backward_fake(grad_elbo, grad_recon, grad_kl, *inputs_saved_flag):
    inputs, (saved, compute_grad_x, *likelihood) = inputs_saved_flag[:12], inputs_saved_flag[12:]
    # csrc/cpu/vae_elbo/backward.cpp's vae_elbo_train_backward_cpu.
    expected = _vae_saved_numel(*_check_backward_args(grad_elbo, grad_recon, grad_kl, *inputs))
    _check_likelihood(likelihood[0] if likelihood else 0)
    check_rank(saved, "saved", 1, "[B * (2H + 3L + I)], vae_elbo_train's fourth output")
    check(saved.shape[0] == expected, "saved must hold B * (2H + 3L + I) = ", expected,
          " elements (vae_elbo_train's fourth output for these inputs), got shape ", shape_str(saved))
    check_same_float_dtype_and_device([(inputs[0], "x"), (saved, "saved")])
    grad_x = inputs[0].new_empty(inputs[0].shape if compute_grad_x else (0,))
    return (grad_x, *(t.new_empty(t.shape) for t in inputs[1:]))


_eager.forbid_double_backward(_BACKWARD_OP, "vae_elbo", "fused_ops.reference.VAE")
_eager.register_autograd(_OP, _vae_elbo_backward, _vae_elbo_setup_context)
_eager.forbid_double_backward(_TRAIN_BACKWARD_OP, "vae_elbo_train", "fused_ops.reference.VAE")
_eager.register_autograd(_TRAIN_OP, _vae_elbo_train_backward, _vae_elbo_train_setup_context)
