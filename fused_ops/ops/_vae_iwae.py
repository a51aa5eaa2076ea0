"""``fused_ops.vae_iwae``: the K-sample importance-weighted bound (IWAE) of
the VAE that :func:`fused_ops.vae_elbo` computes, from its fused
reconstruction terms."""

import math

import torch
from torch import Tensor

from ._vae_elbo import vae_elbo

__all__ = ["vae_iwae"]


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
    if not isinstance(eps, Tensor) or eps.dim() != 3:
        got = list(eps.shape) if isinstance(eps, Tensor) else type(eps).__name__
        raise ValueError(f"eps must be a 3-D tensor [K, B, L] (K samples per input), got {got}")
    if not isinstance(x, Tensor) or x.dim() != 2:
        got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be a 2-D tensor [B, I], got {got}")
    k, b, latent = eps.shape
    if b != x.shape[0]:
        raise ValueError(f"eps.shape[1] must be {x.shape[0]} (B, the batch size of x), got eps shape {list(eps.shape)}")
    if isinstance(w_mu, Tensor) and w_mu.dim() == 2 and latent != w_mu.shape[0]:
        raise ValueError(f"eps.shape[2] must be {w_mu.shape[0]} (L, the latent dimension of w_mu), "
                         f"got eps shape {list(eps.shape)}")
    if k < 1:
        raise ValueError(f"eps must hold at least one sample per input (K >= 1), got shape {list(eps.shape)}")
    weights = (w_enc, b_enc, w_mu, b_mu, w_logvar, b_logvar, w_dec1, b_dec1, w_dec2, b_dec2)
    xk = x.expand(k, *x.shape).reshape(k * b, x.shape[1])
    _, recon, _ = vae_elbo(xk, eps.reshape(k * b, latent), *weights, likelihood=likelihood, dec_logvar=dec_logvar)
    linear = torch.nn.functional.linear
    h = torch.relu(linear(x, w_enc, b_enc))
    mu, logvar = linear(h, w_mu, b_mu), linear(h, w_logvar, b_logvar)
    z = mu + torch.exp(0.5 * logvar) * eps
    log_ratio = (-0.5 * z.square() + 0.5 * eps.square() + 0.5 * logvar).sum(-1)
    log_w = -recon.view(k, b) + log_ratio
    return torch.logsumexp(log_w, 0) - math.log(k), log_w
