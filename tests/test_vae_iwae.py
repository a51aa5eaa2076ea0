"""fused_ops.vae_iwae: the K-sample importance-weighted bound against a
direct implementation with torch.distributions (K = 1 and 5, float32 and
float64, every input's gradient), and its bad inputs (rank, batch, K and
latent mismatches)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Normal

import fused_ops
from fused_test_utils import DTYPES, tol
from op_cases import VAE_ELBO, vae_assert_grads_close, vae_clear_of_relu_kinks


def direct_iwae(x, eps, we, be, wm, bm, wl, bl, w1, b1, w2, b2):
    """Burda et al.'s bound written out: log p(x|z) + log p(z) - log q(z|x) per sample."""
    h = torch.relu(F.linear(x, we, be))
    mu, logvar = F.linear(h, wm, bm), F.linear(h, wl, bl)
    std = torch.exp(0.5 * logvar)
    z = mu + std * eps                                                   # [K, B, L]
    p = torch.sigmoid(F.linear(torch.relu(F.linear(z, w1, b1)), w2, b2))
    log_px = -F.binary_cross_entropy(p, x.expand_as(p), reduction="none").sum(-1)
    log_pz = Normal(torch.zeros_like(z), torch.ones_like(z)).log_prob(z).sum(-1)
    log_qz = Normal(mu, std).log_prob(z).sum(-1)
    log_w = log_px + log_pz - log_qz
    return torch.logsumexp(log_w, 0) - math.log(eps.shape[0]), log_w


def _inputs(size, k, dtype, device):
    def make():
        args = VAE_ELBO.inputs(size, dtype=dtype, device=device)
        args[1] = torch.randn(k, *args[1].shape, dtype=dtype, device=device)
        return [t.requires_grad_() for t in args]
    if dtype == torch.float64:
        return make()
    # ReLU kinks: checked on the first sample's noise (op_table/vae_elbo.py explains the redraws).
    return vae_clear_of_relu_kinks(lambda: make())


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("k", [1, 5])
def test_matches_direct_implementation(k, dtype, device):
    args = _inputs((23, 40, 16, 4), k, dtype, device)
    iwae, log_w = fused_ops.vae_iwae(*args)
    want_iwae, want_log_w = direct_iwae(*args)
    torch.testing.assert_close(log_w, want_log_w, **tol(dtype))
    torch.testing.assert_close(iwae, want_iwae, **tol(dtype))
    names = VAE_ELBO.arg_names
    got = torch.autograd.grad(iwae.sum(), args)
    want = torch.autograd.grad(want_iwae.sum(), args)
    if dtype == torch.float64:
        vae_assert_grads_close(names, got, want, rtol=1e-10, atol_scale=1e-12)
    else:
        vae_assert_grads_close(names, got, want, rtol=1e-3, atol_scale=1e-4)


@pytest.mark.parametrize("change,message", [
    (lambda a: a[1][0], r"eps must be a 3-D tensor \[K, B, L\]"),
    (lambda a: a[1][:, :3], r"eps.shape\[1\] must be 4 \(B, the batch size of x\)"),
    (lambda a: a[1][:0], r"at least one sample per input \(K >= 1\)"),
    (lambda a: a[1][..., :2], r"eps.shape\[2\] must be 3 \(L, the latent dimension of w_mu\)"),
], ids=["eps_2d", "eps_batch", "K_0", "eps_latent"])
def test_bad_inputs(change, message):
    args = VAE_ELBO.inputs((4, 6, 5, 3))
    args[1] = torch.randn(2, 4, 3)
    eps = change(args)
    with pytest.raises(ValueError, match=message):
        fused_ops.vae_iwae(args[0], eps, *args[2:])
