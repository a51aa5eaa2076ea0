"""The reference programs: plain PyTorch, one small kernel per operation.

These are the contract the fused operators are tested against (DESIGN.md
section 2) and the baselines the benchmark times.  They are kept exactly as
users write them; do not "optimise" them.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class ImportanceSampler(nn.Module):
    """Self-normalised importance sampling of a Gaussian-mixture target with a
    diagonal Gaussian proposal.  ``forward(samples[N, D]) -> (weighted_mean[D], ess[])``."""

    def __init__(self, dim, num_components=3):
        super().__init__()
        self.register_buffer("mix_weights", torch.ones(num_components) / num_components)
        self.register_buffer("mix_mus", torch.randn(num_components, dim) * 2.0)
        self.register_buffer("mix_stds", torch.ones(num_components, dim))
        self.register_buffer("q_mu", torch.zeros(dim))
        self.register_buffer("q_std", torch.ones(dim) * 3.0)

    def forward(self, samples):
        weighted_mean, ess, _ = importance_sampling(
            samples, self.mix_weights, self.mix_mus, self.mix_stds, self.q_mu, self.q_std
        )
        return weighted_mean, ess


def importance_sampling(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std):
    """Functional form of :class:`ImportanceSampler`, returning
    ``(weighted_mean[D], ess[], log_weights[N])`` like the fused op."""
    x = samples
    diff = (x[:, None, :] - mix_mus[None, :, :]) / mix_stds[None, :, :]
    log_comp = (-0.5 * diff**2 - torch.log(mix_stds)[None, :, :]).sum(-1)
    log_p = torch.logsumexp(log_comp + torch.log(mix_weights)[None, :], dim=-1)
    log_q = (-0.5 * ((x - q_mu) / q_std) ** 2 - torch.log(q_std)).sum(-1)
    log_w = log_p - log_q
    log_w = log_w - torch.logsumexp(log_w, dim=0)
    w = torch.exp(log_w)
    return (w[:, None] * x).sum(0), 1.0 / (w**2).sum(), log_w


class FlowODE(nn.Module):
    """Probability-flow ODE sampler: ``num_steps`` Euler steps of an MLP
    velocity field, time as the last input feature.  ``forward(x0[B, D]) -> x[B, D]``."""

    def __init__(self, dim, num_steps):
        super().__init__()
        self.velocity = nn.Sequential(
            nn.Linear(dim + 1, 4 * dim),
            nn.SiLU(),
            nn.Linear(4 * dim, 4 * dim),
            nn.SiLU(),
            nn.Linear(4 * dim, dim),
        )
        self.num_steps = num_steps
        self.register_buffer("dt", torch.tensor(1.0 / num_steps))

    def forward(self, x0):
        x = x0
        batch = x.shape[0]
        for k in range(self.num_steps):
            t = (k + 0.5) / self.num_steps
            u = torch.cat([x, torch.full((batch, 1), t, dtype=x.dtype, device=x.device)], dim=-1)
            x = x + self.dt * self.velocity(u)
        return x


class VAE(nn.Module):
    """VAE forward pass with reparameterisation, BCE reconstruction and KL.
    ``forward(x[B, I], eps=None) -> (elbo[B], recon[B], kl[B])``."""

    def __init__(self, input_dim, hidden_dim, latent_dim):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(input_dim, hidden_dim), nn.ReLU())
        self.fc_mu = nn.Linear(hidden_dim, latent_dim)
        self.fc_logvar = nn.Linear(hidden_dim, latent_dim)
        self.decoder = nn.Sequential(
            nn.Linear(latent_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, input_dim),
            nn.Sigmoid(),
        )

    def forward(self, x, eps=None):
        h = self.encoder(x)
        mu = self.fc_mu(h)
        logvar = self.fc_logvar(h)
        if eps is None:
            eps = torch.randn_like(mu)
        z = mu + torch.exp(0.5 * logvar) * eps
        p = self.decoder(z)
        recon = F.binary_cross_entropy(p, x, reduction="none").sum(-1)
        kl = -0.5 * (1 + logvar - mu**2 - torch.exp(logvar)).sum(-1)
        elbo = -(recon + kl)
        return elbo, recon, kl


class ExamplesVAE(nn.Module):
    """The VAE of pytorch/examples' ``vae/main.py`` (MNIST): ``fc1`` 784-400,
    ``fc21`` (mu) and ``fc22`` (logvar) 400-20, ``fc3`` 20-400, ``fc4``
    400-784.  ``forward(x[B, ...], eps=None) -> (recon_x[B, 784], mu[B, 20],
    logvar[B, 20])`` as the example computes them (it flattens ``x`` with
    ``view(-1, 784)``); ``eps`` defaults to ``torch.randn_like`` of the
    standard deviation, the example's one random call.  Its loss is
    :func:`examples_loss_function`."""

    def __init__(self, input_dim=784, hidden_dim=400, latent_dim=20):
        super().__init__()
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.fc21 = nn.Linear(hidden_dim, latent_dim)
        self.fc22 = nn.Linear(hidden_dim, latent_dim)
        self.fc3 = nn.Linear(latent_dim, hidden_dim)
        self.fc4 = nn.Linear(hidden_dim, input_dim)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar, eps=None):
        std = torch.exp(0.5 * logvar)
        if eps is None:
            eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x, eps=None):
        mu, logvar = self.encode(x.view(-1, self.fc1.in_features))
        z = self.reparameterize(mu, logvar, eps)
        return self.decode(z), mu, logvar


def examples_loss_function(recon_x, x, mu, logvar):
    """pytorch/examples' VAE loss: BCE summed over all elements and the
    batch, plus the KL divergence summed likewise (a 0-d tensor)."""
    bce = F.binary_cross_entropy(recon_x, x.view(-1, recon_x.shape[-1]), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def flow_euler(x0, w1, b1, w2, b2, w3, b3, num_steps):
    """Functional form of :class:`FlowODE` with explicit weights (any hidden
    width), computing what the fused op computes: the module's loop with
    ``velocity = Linear(w1, b1), SiLU, Linear(w2, b2), SiLU, Linear(w3, b3)``
    and ``dt = tensor(1.0 / num_steps)`` in the input's dtype."""
    dt = torch.tensor(1.0 / num_steps, dtype=x0.dtype, device=x0.device)
    x = x0
    batch = x.shape[0]
    for k in range(num_steps):
        t = (k + 0.5) / num_steps
        u = torch.cat([x, torch.full((batch, 1), t, dtype=x.dtype, device=x.device)], dim=-1)
        v = F.linear(F.silu(F.linear(F.silu(F.linear(u, w1, b1)), w2, b2)), w3, b3)
        x = x + dt * v
    return x


def snis(log_weights, samples=None, moments=False):
    """Self-normalised importance sampling of given log weights, as users
    write it: ``log_weights [..., N]``, ``samples [..., N, D]`` (optional).
    Returns ``(log_norm_weights [..., N], ess [...], log_evidence [...],
    mean [..., D], variance [..., D])`` like the fused op (``mean`` and
    ``variance`` empty ``[0]`` when not asked for)."""
    n = log_weights.shape[-1]
    lse = torch.logsumexp(log_weights, dim=-1, keepdim=True)
    log_norm_weights = log_weights - lse
    w = torch.exp(log_norm_weights)
    ess = 1.0 / (w**2).sum(-1)
    log_evidence = lse.squeeze(-1) - math.log(n)
    empty = log_weights.new_empty(0)
    mean = variance = empty
    if samples is not None:
        mean = (w[..., None] * samples).sum(-2)
        if moments:
            variance = (w[..., None] * (samples - mean[..., None, :]) ** 2).sum(-2)
    return log_norm_weights, ess, log_evidence, mean, variance


class SNIS(nn.Module):
    """:func:`snis` as a module (no parameters): ``forward(log_weights [..., N],
    samples [..., N, D] or None) -> (log_norm_weights, ess, log_evidence, mean, variance)``."""

    def __init__(self, moments=False):
        super().__init__()
        self.moments = moments

    def forward(self, log_weights, samples=None):
        return snis(log_weights, samples, self.moments)


def resample(log_weights, uniforms, num_samples, method):
    """Resampling as a user writes it: a float64 CDF (``cumsum``) searched with
    ``searchsorted`` at the sorted positions of ``fused_ops.resample``'s
    method (see its docstring), ``[..., N] -> int64 [..., M]``."""
    lw = log_weights.double()
    w = torch.exp(lw - lw.max(-1, keepdim=True).values)
    cdf = torch.cumsum(w, -1)
    k = torch.arange(num_samples, dtype=torch.float64, device=lw.device)
    if method == "multinomial":
        pos = -torch.expm1(torch.cumsum(torch.log1p(-uniforms) / (num_samples - k), -1))
    else:  # stratified: uniforms [..., M]; systematic: [..., 1], one shared offset
        pos = (k + uniforms) / num_samples
    idx = torch.searchsorted(cdf, (pos * cdf[..., -1:]).contiguous(), right=True)
    n = torch.arange(lw.shape[-1], device=lw.device)
    last_positive = torch.where(w > 0, n, 0).amax(-1, keepdim=True)
    return torch.minimum(idx, last_positive)


def mixture_log_density(samples, weights, mus, stds):
    """Log density (without the -D/2 log 2 pi term) of a diagonal Gaussian
    mixture at ``samples [..., N, D]``: ``weights [..., K]``, ``mus``,
    ``stds [..., K, D]`` -> ``[..., N]``."""
    diff = (samples[..., :, None, :] - mus[..., None, :, :]) / stds[..., None, :, :]
    log_comp = (-0.5 * diff**2 - torch.log(stds)[..., None, :, :]).sum(-1)
    return torch.logsumexp(log_comp + torch.log(weights)[..., None, :], dim=-1)


def importance_log_weights(samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds):
    """``log p(x) - log q(x)`` as users write it, target and proposal diagonal
    Gaussian mixtures, leading batch dimensions independent problems:
    ``samples [..., N, D]``, ``*_weights [..., K]``, ``*_mus``, ``*_stds
    [..., K, D]`` -> ``[..., N]``, like ``fused_ops.importance_log_weights``."""
    return (mixture_log_density(samples, mix_weights, mix_mus, mix_stds)
            - mixture_log_density(samples, q_weights, q_mus, q_stds))


def importance_sampling_batched(samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds):
    """Self-normalised importance sampling of :func:`importance_log_weights`:
    ``(weighted_mean [..., D], ess [...], log_weights [..., N], log_evidence [...])``,
    what ``fused_ops.importance_sampling(..., q_weights=..., return_evidence=True)``
    computes."""
    lw = importance_log_weights(samples, mix_weights, mix_mus, mix_stds, q_weights, q_mus, q_stds)
    lnw, ess, log_evidence, mean, _ = snis(lw, samples)
    return mean, ess, lnw, log_evidence
