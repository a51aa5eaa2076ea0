"""``fused_ops.vae_mlp_elbo``: the per-sample ELBO of a VAE whose encoder and
decoder are MLPs of 1 to 4 hidden layers, with one ``[mu | logvar]`` head.

The function, the fakes and the autograd registration of the ops
``fused_ops::vae_mlp_elbo`` and ``fused_ops::vae_mlp_elbo_backward``
(kernels: ``csrc/cpu/vae_mlp/``, ``csrc/cuda/vae_mlp/``; math:
``csrc/vae_mlp.h``).  ``fused_ops.vae_elbo`` keeps the one-hidden-layer ReLU
layout with its fast kernels; this op is the general case beside it.
"""

import torch
from torch import Tensor

from . import _dtypes
from ._checks import check, check_rank, check_same_float_dtype_and_device, check_size, shape_str
from ._ode import _TORCH_ACTS_BY_CODE, _act, check_activation_code
from ._vae_elbo import LIKELIHOODS, likelihood_code

__all__ = ["vae_mlp_elbo", "MAX_HIDDEN"]

_OP = torch.ops.fused_ops.vae_mlp_elbo.default
_BACKWARD_OP = torch.ops.fused_ops.vae_mlp_elbo_backward.default

#: Hidden layers per network, at most.
MAX_HIDDEN = 4


def activation_code(activation, act_param=None):
    """``(code, parameter)`` of an activation: a name (``fused_ops.ops._ode.ACTIVATIONS``,
    its default parameter when ``act_param`` is None) or the op's int code."""
    if isinstance(activation, int) and not isinstance(activation, bool):  # the op's code (the schema's form)
        return activation, float(0.0 if act_param is None else act_param)
    return _act(activation, act_param)


def mlp_encode(x, enc_weights, enc_biases, w_head, b_head, activation, act_param):
    """``(mu, logvar)`` of the encoder and head in PyTorch (``activation`` an
    int code): what the fused ops compute inside, for callers that need them
    as differentiable tensors."""
    act = _TORCH_ACTS_BY_CODE[activation]
    h = x
    for w, b in zip(enc_weights, enc_biases):
        h = act(torch.nn.functional.linear(h, w, b), act_param)
    return torch.nn.functional.linear(h, w_head, b_head).chunk(2, -1)


def vae_mlp_elbo(
    x: Tensor,
    eps: Tensor,
    enc_weights: list,
    enc_biases: list,
    w_head: Tensor,
    b_head: Tensor,
    dec_weights: list,
    dec_biases: list,
    *,
    activation: str = "relu",
    act_param: float | None = None,
    likelihood: str = "bernoulli",
    dec_logvar: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Per-sample ELBO terms of a VAE with MLP encoder and decoder, fused.

    Shapes (``nn.Linear`` weight layout ``[out, in]``): ``x [B, ...]``
    (flattened to ``[B, I]`` as the first Linear expects), ``eps [B, L]``,
    ``enc_weights``: 1 to 4 tensors ``[H_1, I], [H_2, H_1], ...``,
    ``enc_biases`` one ``[H_l]`` each; ``w_head [2L, H_Le]``, ``b_head [2L]``
    (rows ``:L`` give mu, ``L:`` logvar -- two Linears ``fc_mu``,
    ``fc_logvar`` are ``torch.cat``-ed: autograd splits the gradient back);
    ``dec_weights``: 2 to 5 tensors (1 to 4 hidden layers, then the output
    layer ``[I, G_last]``), ``dec_biases`` one each.  All float32 or all
    float64 on one device; all-bfloat16/float16 inputs compute in float32 and
    return their dtype, and under ``torch.autocast`` float32 is used
    (``fused_ops/ops/_dtypes.py``), as for :func:`fused_ops.vae_elbo`.

    Math (``act`` the same across both networks)::

        h = x;  h = act(h @ E_l.T + e_l)                for each encoder layer
        mu, logvar = (h @ w_head.T + b_head).split(L, -1)
        z = mu + exp(0.5 * logvar) * eps
        g = z;  g = act(g @ D_l.T + d_l)                for each decoder hidden layer
        a = g @ D_out.T + d_out                         # logits / means [B, I]
        recon = term(a, x).sum(-1);  kl = -0.5 * (1 + logvar - mu**2 - exp(logvar)).sum(-1)
        elbo = -(recon + kl)

    ``activation``: ``"relu"``, ``"leaky_relu"`` (``act_param`` the negative
    slope, default 0.01), ``"elu"`` (alpha, default 1), ``"silu"``,
    ``"gelu"`` (exact), ``"gelu_tanh"`` (``approximate="tanh"``),
    ``"tanh"``; also ``"selu"``, ``"softplus"`` (beta), ``"sigmoid"``: each
    as ``torch.nn.functional`` computes it (``csrc/common/activations.h``).
    ``activation`` and ``likelihood`` also take the op's int codes.

    ``likelihood`` is one of :data:`fused_ops.LIKELIHOODS`, the term the
    PyTorch expression gives (per sample, summed over features)::

        "bernoulli"         F.binary_cross_entropy(torch.sigmoid(a), x, reduction="none")
        "bernoulli_logits"  F.binary_cross_entropy_with_logits(a, x, reduction="none")
        "gaussian_sigmoid"  F.mse_loss(torch.sigmoid(a), x, reduction="none")
        "gaussian"          F.mse_loss(a, x, reduction="none")

    and with ``dec_logvar [I]`` (``likelihood="gaussian"``; a learned
    per-feature log-variance, differentiable) the Gaussian negative
    log-likelihood ``-Normal(a, exp(0.5 * dec_logvar)).log_prob(x)``,
    computed in the kernel.  "bernoulli" needs targets in [0, 1]: the CPU
    kernel raises naming the first other element (as
    ``binary_cross_entropy`` does); on CUDA such a row's terms are NaN.

    Returns ``(elbo [B], recon [B], kl [B])``; differentiable with respect to
    every tensor input through ``fused_ops::vae_mlp_elbo_backward``, which
    recomputes the forward (only the inputs are saved) and, when x needs no
    gradient (``grad_x=False``), skips x's.  Deterministic on
    both devices.  Double backward and torch.func transforms are not
    supported.
    """
    if isinstance(x, Tensor) and x.dim() > 2:
        x = x.reshape(x.shape[0], -1)
    act, param = activation_code(activation, act_param)
    is_code = isinstance(likelihood, int) and not isinstance(likelihood, bool)
    lik = likelihood if is_code else likelihood_code(likelihood)
    enc_weights, enc_biases, dec_weights, dec_biases = (
        list(v) for v in (enc_weights, enc_biases, dec_weights, dec_biases))
    flat = [x, eps, *enc_weights, *enc_biases, w_head, b_head, *dec_weights, *dec_biases]
    if dec_logvar is not None:
        flat.append(dec_logvar)
    names = ["x", "eps", *(f"enc_weights[{i}]" for i in range(len(enc_weights))),
             *(f"enc_biases[{i}]" for i in range(len(enc_biases))), "w_head", "b_head",
             *(f"dec_weights[{i}]" for i in range(len(dec_weights))),
             *(f"dec_biases[{i}]" for i in range(len(dec_biases))), "dec_logvar"]
    flat, out_dtype = _dtypes.to_compute_dtype(names, tuple(flat))
    it = iter(flat)
    x, eps = next(it), next(it)
    ew = [next(it) for _ in enc_weights]
    eb = [next(it) for _ in enc_biases]
    wh, bh = next(it), next(it)
    dw = [next(it) for _ in dec_weights]
    db = [next(it) for _ in dec_biases]
    lv = next(it) if dec_logvar is not None else None
    return _dtypes.from_compute_dtype(_OP(x, eps, ew, eb, wh, bh, dw, db, lv, act, param, lik), out_dtype)


def _named(prefix, tensors):
    return [(t, f"{prefix}[{i}]") for i, t in enumerate(tensors)]


def _chain(ws, bs, net, width, in_what):
    for l, (w, b) in enumerate(zip(ws, bs)):
        wn, bn = f"{net}_weights[{l}]", f"{net}_biases[{l}]"
        check_rank(w, wn, 2, "[out, in]")
        check(w.shape[0] >= 1, wn, " must have at least one output, got shape ", shape_str(w))
        check_size(w, wn, 1, width, in_what if l == 0 else "the output width of the layer before")
        check_rank(b, bn, 1, "[out]")
        check_size(b, bn, 0, w.shape[0], f"the output width of {wn}")
        width = w.shape[0]
    return width


def _check_args(x, eps, ew, eb, wh, bh, dw, db, dec_logvar, activation, likelihood):
    """csrc/vae_mlp.h's VaeMlpInputs checks, in its order and with its messages; returns ``(B, I, L)``."""
    check_activation_code(activation)
    check((likelihood >= 0) & (likelihood < len(LIKELIHOODS)), "likelihood must be 0 (Bernoulli), 1 (Bernoulli ",
          "from logits), 2 (Gaussian, mean sigmoid(logits)) or 3 (Gaussian, mean = logits), got ", likelihood)
    check_rank(x, "x", 2, "[B, I]")
    check_rank(eps, "eps", 2, "[B, L]")
    (b, i), l_ = x.shape, eps.shape[1]
    check(i >= 1, "x must have at least one feature (I >= 1), got shape ", shape_str(x))
    check_size(eps, "eps", 0, b, "B, the batch size of x")
    check(l_ >= 1, "eps must have at least one latent unit (L >= 1), got shape ", shape_str(eps))
    check(1 <= len(ew) <= MAX_HIDDEN,
          "enc_weights must hold 1 to 4 Linear weights (the encoder's hidden layers), got ", len(ew))
    check(len(eb) == len(ew), "enc_biases must hold one bias per encoder layer (", len(ew), "), got ", len(eb))
    check(2 <= len(dw) <= MAX_HIDDEN + 1,
          "dec_weights must hold 2 to 5 Linear weights (1 to 4 hidden layers and the output layer), got ", len(dw))
    check(len(db) == len(dw), "dec_biases must hold one bias per decoder layer (", len(dw), "), got ", len(db))
    h = _chain(ew, eb, "enc", i, "I, the features of x")
    check_rank(wh, "w_head", 2, "[2L, H]")
    check_rank(bh, "b_head", 1, "[2L]")
    check_size(wh, "w_head", 0, 2 * l_, "2L: mu and logvar rows, L = eps.shape[1]")
    check_size(wh, "w_head", 1, h, "the output width of the last encoder layer")
    check_size(bh, "b_head", 0, 2 * l_, "2L: mu and logvar, L = eps.shape[1]")
    _chain(dw, db, "dec", l_, "L, the latent units of eps")
    check_size(dw[-1], f"dec_weights[{len(dw) - 1}]", 0, i, "I: the last decoder layer gives the features of x")
    if dec_logvar is not None:
        check(likelihood == LIKELIHOODS["gaussian"], "dec_logvar (a learned per-feature log-variance) needs ",
              "likelihood 3 (Gaussian, mean = logits), got likelihood ", likelihood)
        check_rank(dec_logvar, "dec_logvar", 1, "[I]")
        check_size(dec_logvar, "dec_logvar", 0, i, "I, the features of x")
    check_same_float_dtype_and_device([(x, "x"), (eps, "eps")])
    for pairs in zip(_named("enc_weights", ew), _named("enc_biases", eb)):
        for p in pairs:
            check_same_float_dtype_and_device([(x, "x"), p])
    check_same_float_dtype_and_device([(x, "x"), (wh, "w_head")])
    check_same_float_dtype_and_device([(x, "x"), (bh, "b_head")])
    for pairs in zip(_named("dec_weights", dw), _named("dec_biases", db)):
        for p in pairs:
            check_same_float_dtype_and_device([(x, "x"), p])
    if dec_logvar is not None:
        check_same_float_dtype_and_device([(x, "x"), (dec_logvar, "dec_logvar")])
    return b, i, l_


@torch.library.register_fake("fused_ops::vae_mlp_elbo")
def _vae_mlp_elbo_fake(x, eps, ew, eb, wh, bh, dw, db, dec_logvar, activation, act_param, likelihood):
    b = _check_args(x, eps, ew, eb, wh, bh, dw, db, dec_logvar, activation, likelihood)[0]
    return x.new_empty(b), x.new_empty(b), x.new_empty(b)


@torch.library.register_fake("fused_ops::vae_mlp_elbo_backward")
def _vae_mlp_elbo_backward_fake(ge, gr, gk, x, eps, ew, eb, wh, bh, dw, db, dec_logvar, activation, act_param,
                                likelihood, grad_x=True):
    b = _check_args(x, eps, ew, eb, wh, bh, dw, db, dec_logvar, activation, likelihood)[0]
    for g, name in ((ge, "grad_elbo"), (gr, "grad_recon"), (gk, "grad_kl")):
        if g is not None:
            check_rank(g, name, 1, "[B]")
            check_size(g, name, 0, b, "B, the batch size of x")
            check_same_float_dtype_and_device([(x, "x"), (g, name)])
    ts = [x, eps, *ew, *eb, wh, bh, *dw, *db] + ([dec_logvar] if dec_logvar is not None else [])
    out = [t.new_empty(t.shape) for t in ts]
    if not grad_x:  # x's gradient not computed: an empty tensor in its place
        out[0] = x.new_empty(0)
    return out


def _setup_context(ctx, inputs, output):
    # Only the inputs: the backward op recomputes the activations.  Unused
    # outputs' gradients stay None (read as zero by the backward op).
    x, eps, ew, eb, wh, bh, dw, db, dec_logvar, *scalars = inputs
    ctx.counts = (len(ew), len(dw), dec_logvar is not None)
    ctx.scalars = tuple(scalars)
    ctx.save_for_backward(x, eps, *ew, *eb, wh, bh, *dw, *db, *([dec_logvar] if dec_logvar is not None else []))
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_elbo, grad_recon, grad_kl):
    r"""The gradients of every tensor input, by ``fused_ops::vae_mlp_elbo_backward``:
    with ``d = grad_recon - grad_elbo`` and ``c = grad_kl - grad_elbo`` per
    row, the likelihood's backward gives the gradient at the logits and at x
    (``csrc/common/likelihood.h``), the decoder's chain rule reaches z,
    ``gmu = gz + c mu``, ``glogvar = gz eps std / 2 - c (1 - exp(logvar)) / 2``,
    ``geps = gz std``, the encoder's chain rule reaches x; each weight gradient
    one product over the batch, each bias gradient a column sum."""
    le, ld, has_lv = ctx.counts
    s = list(ctx.saved_tensors)
    x, eps = s[0], s[1]
    ew, eb = s[2:2 + le], s[2 + le:2 + 2 * le]
    wh, bh = s[2 + 2 * le], s[3 + 2 * le]
    dw, db = s[4 + 2 * le:4 + 2 * le + ld], s[4 + 2 * le + ld:4 + 2 * le + 2 * ld]
    lv = s[-1] if has_lv else None
    grad_x = ctx.needs_input_grad[0]  # else the op skips its largest product (x's gradient through layer 0)
    g = _BACKWARD_OP(grad_elbo, grad_recon, grad_kl, x, eps, ew, eb, wh, bh, dw, db, lv, *ctx.scalars, grad_x)
    ge_w, ge_b = g[2:2 + le], g[2 + le:2 + 2 * le]
    gd_w, gd_b = g[4 + 2 * le:4 + 2 * le + ld], g[4 + 2 * le + ld:4 + 2 * le + 2 * ld]
    return (g[0] if grad_x else None, g[1], list(ge_w), list(ge_b), g[2 + 2 * le], g[3 + 2 * le], list(gd_w),
            list(gd_b), g[-1] if has_lv else None, None, None, None)


torch.library.register_autograd("fused_ops::vae_mlp_elbo", _backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "fused_ops.vae_mlp_elbo does not support double backward: double backward through its fused backward "
        "(fused_ops::vae_mlp_elbo_backward; e.g. create_graph=True followed by another backward) is not supported; "
        "use the plain PyTorch model for higher-order derivatives")


torch.library.register_autograd("fused_ops::vae_mlp_elbo_backward", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None)
