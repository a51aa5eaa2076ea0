"""``fused_ops.vae_iwae`` and ``fused_ops.vae_mlp_iwae``: the K-sample
importance-weighted bound (IWAE) of the VAEs that :func:`fused_ops.vae_elbo`
and :func:`fused_ops.vae_mlp_elbo` compute, from their fused reconstruction
terms."""

import math

import torch
from torch import Tensor

from ._vae_elbo import vae_elbo
from ._vae_mlp import activation_code, mlp_encode, vae_mlp_elbo

__all__ = ["vae_iwae", "vae_mlp_iwae"]


def _check_iwae_shapes(x, eps, latent_dim, latent_what):
    """(K, B, L) of eps [K, B, L] against x [B, I] and the model's latent size."""
    if not isinstance(eps, Tensor) or eps.dim() != 3:
        got = list(eps.shape) if isinstance(eps, Tensor) else type(eps).__name__
        raise ValueError(f"eps must be a 3-D tensor [K, B, L] (K samples per input), got {got}")
    if not isinstance(x, Tensor) or x.dim() != 2:
        got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D tensor [B, I], got {got}")
    k, b, latent = eps.shape
    if b != x.shape[0]:
        raise ValueError(f"eps.shape[1] must be {x.shape[0]} (B, the batch size of x), got eps shape {list(eps.shape)}")
    if latent_dim is not None and latent != latent_dim:
        raise ValueError(f"eps.shape[2] must be {latent_dim} ({latent_what}), got eps shape {list(eps.shape)}")
    if k < 1:
        raise ValueError(f"eps must hold at least one sample per input (K >= 1), got shape {list(eps.shape)}")
    return k, b, latent


def _bound(recon, mu, logvar, eps):
    """``(iwae [B], log_w [K, B])`` from the K * B reconstruction terms and the encoder's mu, logvar [B, L]."""
    k, b, _ = eps.shape
    z = mu + torch.exp(0.5 * logvar) * eps
    log_ratio = (-0.5 * z.square() + 0.5 * eps.square() + 0.5 * logvar).sum(-1)
    log_w = -recon.view(k, b) + log_ratio
    return torch.logsumexp(log_w, 0) - math.log(k), log_w


def vae_iwae(
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
    dec_logvar: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""The importance-weighted bound of Burda et al. with K samples per
    input: ``x [B, I]``, ``eps [K, B, L]`` (K draws of the standard normal
    noise per sample), the weights as in :func:`fused_ops.vae_elbo`.

    Math, with ``z[k, b] = mu[b] + exp(0.5 * logvar[b]) * eps[k, b]``::

        log_w[k, b] = -recon(x[b], z[k, b])                      # log p(x | z), the likelihood's term
                      + sum_l(-0.5 z**2 + 0.5 eps**2 + 0.5 logvar) # log p(z) - log q(z | x)
        iwae[b]     = logsumexp_k(log_w[k, b]) - log(K)

    (the ``log(2 pi)`` terms of ``p(z)`` and ``q(z | x)`` cancel).
    ``recon`` is the ``likelihood``'s reconstruction term of
    :func:`fused_ops.vae_elbo`: for "bernoulli" and "bernoulli_logits" and
    the Gaussian with ``dec_logvar`` exactly ``-log p(x | z)``; for the
    fixed-variance "gaussian" / "gaussian_sigmoid" MSE terms the bound of
    that pseudo-likelihood (a constant per sample away from the Gaussian's).

    Returns ``(iwae [B], log_w [K, B])``, differentiable in every tensor.
    The K * B reconstruction terms come from one fused call on x repeated
    K times; mu and logvar for the density ratio from PyTorch's encoder
    products (one more ``[B, I] x [I, H]`` product).  ``-iwae.sum()`` is the
    loss; K = 1 gives the single-sample ELBO estimate (the sampled, not the
    analytic, KL).
    """
    latent_dim = w_mu.shape[0] if isinstance(w_mu, Tensor) and w_mu.dim() == 2 else None
    k, b, latent = _check_iwae_shapes(x, eps, latent_dim, "L, the latent dimension of w_mu")
    weights = (w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2)
    xk = x.expand(k, *x.shape).reshape(k * b, x.shape[1])
    _, recon, _ = vae_elbo(xk, eps.reshape(k * b, latent), *weights, likelihood=likelihood, dec_logvar=dec_logvar)
    linear = torch.nn.functional.linear
    h = torch.relu(linear(x, w_enc, b_enc))
    return _bound(recon, linear(h, w_mu, b_mu), linear(h, w_logvar, b_logvar), eps)


def vae_mlp_iwae(
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
) -> tuple[Tensor, Tensor]:
    r"""The importance-weighted bound of the MLP VAE of
    :func:`fused_ops.vae_mlp_elbo` with K samples per input: ``x [B, ...]``
    (flattened to ``[B, I]``), ``eps [K, B, L]``, the layers, ``activation``,
    ``likelihood`` and ``dec_logvar`` as there.

    Math: as :func:`fused_ops.vae_iwae`, with ``mu, logvar`` from the MLP
    encoder and its ``[mu | logvar]`` head::

        log_w[k, b] = -recon(x[b], z[k, b]) + sum_l(-0.5 z**2 + 0.5 eps**2 + 0.5 logvar)
        iwae[b]     = logsumexp_k(log_w[k, b]) - log(K)

    Returns ``(iwae [B], log_w [K, B])``, differentiable in every tensor.
    The K * B reconstruction terms come from one fused ``vae_mlp_elbo`` call
    on x repeated K times; mu and logvar for the density ratio from
    PyTorch's encoder (its products once more, on the B inputs).
    """
    if isinstance(x, Tensor) and x.dim() > 2:
        x = x.reshape(x.shape[0], -1)
    latent_dim = w_head.shape[0] // 2 if isinstance(w_head, Tensor) and w_head.dim() == 2 else None
    k, b, latent = _check_iwae_shapes(x, eps, latent_dim, "L, half the rows of w_head")
    code, param = activation_code(activation, act_param)
    xk = x.expand(k, *x.shape).reshape(k * b, x.shape[1])
    _, recon, _ = vae_mlp_elbo(xk, eps.reshape(k * b, latent), enc_weights, enc_biases, w_head, b_head, dec_weights,
                               dec_biases, activation=code, act_param=param, likelihood=likelihood,
                               dec_logvar=dec_logvar)
    return _bound(recon, *mlp_encode(x, enc_weights, enc_biases, w_head, b_head, code, param), eps)
