"""fused_ops.vae_iwae and vae_mlp_iwae: the K-sample importance-weighted bound against a
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


def _mlp_layers(i, enc, latent, dec, dtype, device):
    """Weights and biases of an MLP VAE (nn.Linear layout, fan-in scaled):
    encoder widths ``enc``, a [mu | logvar] head, decoder widths ``dec``."""
    def layer(n_out, n_in):
        w = torch.randn(n_out, n_in, dtype=dtype, device=device) / n_in**0.5
        return w.requires_grad_(), (0.1 * torch.randn(n_out, dtype=dtype, device=device)).requires_grad_()

    ins, outs = [i, *enc[:-1]], enc
    enc_layers = [layer(o, n) for o, n in zip(outs, ins)]
    head = layer(2 * latent, enc[-1])
    dec_layers = [layer(o, n) for o, n in zip([*dec, i], [latent, *dec])]
    return ([w for w, _ in enc_layers], [b for _, b in enc_layers], *head,
            [w for w, _ in dec_layers], [b for _, b in dec_layers])


def direct_mlp_iwae(x, eps, ew, eb, wh, bh, dw, db, dec_logvar):
    """Burda et al.'s bound of a SiLU MLP VAE, written out with torch.distributions:
    Bernoulli(sigmoid(a)) likelihood, or Normal(a, exp(0.5 dec_logvar)) when given."""
    h = x
    for w, b in zip(ew, eb):
        h = F.silu(F.linear(h, w, b))
    mu, logvar = F.linear(h, wh, bh).chunk(2, -1)
    std = torch.exp(0.5 * logvar)
    z = mu + std * eps                                                   # [K, B, L]
    g = z
    for w, b in zip(dw[:-1], db[:-1]):
        g = F.silu(F.linear(g, w, b))
    a = F.linear(g, dw[-1], db[-1])
    if dec_logvar is None:
        log_px = -F.binary_cross_entropy(torch.sigmoid(a), x.expand_as(a), reduction="none").sum(-1)
    else:
        log_px = Normal(a, torch.exp(0.5 * dec_logvar)).log_prob(x).sum(-1)
    log_w = log_px + Normal(torch.zeros_like(z), torch.ones_like(z)).log_prob(z).sum(-1) \
        - Normal(mu, std).log_prob(z).sum(-1)
    return torch.logsumexp(log_w, 0) - math.log(eps.shape[0]), log_w


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("likelihood", ["bernoulli", "gaussian_learned"])
@pytest.mark.parametrize("k", [1, 4])
def test_mlp_matches_direct_implementation(k, likelihood, dtype, device):
    # Two SiLU hidden layers each side (a smooth activation: float32
    # gradients compare too), odd widths, inputs as an image batch.
    b, i, latent = 19, 15, 3
    x = torch.rand(b, 3, 5, dtype=dtype, device=device)
    eps = torch.randn(k, b, latent, dtype=dtype, device=device, requires_grad=True)
    ew, eb, wh, bh, dw, db = _mlp_layers(i, [11, 7], latent, [6, 9], dtype, device)
    dec_logvar = None
    if likelihood == "gaussian_learned":
        x = torch.randn(b, 3, 5, dtype=dtype, device=device)
        dec_logvar = (0.3 * torch.randn(i, dtype=dtype, device=device)).requires_grad_()
    iwae, log_w = fused_ops.vae_mlp_iwae(x, eps, ew, eb, wh, bh, dw, db, activation="silu",
                                         likelihood="gaussian" if dec_logvar is not None else "bernoulli",
                                         dec_logvar=dec_logvar)
    want_iwae, want_log_w = direct_mlp_iwae(x.reshape(b, i), eps, ew, eb, wh, bh, dw, db, dec_logvar)
    torch.testing.assert_close(log_w, want_log_w, **tol(dtype))
    torch.testing.assert_close(iwae, want_iwae, **tol(dtype))
    params = [eps, *ew, *eb, wh, bh, *dw, *db] + ([dec_logvar] if dec_logvar is not None else [])
    got = torch.autograd.grad(iwae.sum(), params)
    want = torch.autograd.grad(want_iwae.sum(), params)
    rtol, atol = (1e-10, 1e-12) if dtype == torch.float64 else (1e-4, 1e-5)
    for n, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol * max(w.abs().max().item(), 1.0),
                                   msg=lambda m, n=n: f"parameter {n}: {m}")


def test_mlp_bad_inputs():
    ew, eb, wh, bh, dw, db = _mlp_layers(6, [5], 2, [4], torch.float32, "cpu")
    x = torch.rand(4, 6)
    with pytest.raises(ValueError, match=r"eps.shape\[2\] must be 2 \(L, half the rows of w_head\)"):
        fused_ops.vae_mlp_iwae(x, torch.randn(3, 4, 5), ew, eb, wh, bh, dw, db)
    with pytest.raises(ValueError, match=r"eps.shape\[1\] must be 4 \(B, the batch size of x\)"):
        fused_ops.vae_mlp_iwae(x, torch.randn(3, 2, 2), ew, eb, wh, bh, dw, db)
    with pytest.raises(ValueError, match=r"eps must be a 3-D tensor"):
        fused_ops.vae_mlp_iwae(x, torch.randn(4, 2), ew, eb, wh, bh, dw, db)
