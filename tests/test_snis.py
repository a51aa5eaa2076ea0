"""What only snis has (the contract tests cover the rest through the op
table, op_table/snis.py): a torch.distributions target and proposal, the
optional outputs, batched against looped calls, log weights in the
thousands, and the documented handling of -inf, +inf and NaN."""

import math

import pytest
import torch
from torch import distributions as dist

import fused_ops
from fused_ops import reference
from fused_test_utils import DEVICE_PARAMS, sync


def _mixture(device, dtype):
    k, d = 3, 2
    g = torch.Generator().manual_seed(0)
    means = (torch.randn(k, d, generator=g) * 2).to(device, dtype)
    stds = (torch.rand(k, d, generator=g) + 0.5).to(device, dtype)
    logits = torch.randn(k, generator=g).to(device, dtype)
    comp = dist.Independent(dist.Normal(means, stds), 1)
    return dist.MixtureSameFamily(dist.Categorical(logits=logits), comp), means, stds, logits


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_mixture_target_against_distributions_in_float64(device):
    # p: a Gaussian mixture, q: a wide Gaussian, both torch.distributions;
    # the fused estimate equals plain float64 logsumexp code on the same
    # weights, and the estimates converge to the mixture's moments (p is
    # normalised: the evidence is log 1 = 0).
    p, means, stds, logits = _mixture(device, torch.float64)
    q = dist.Independent(dist.Normal(torch.zeros(2, dtype=torch.float64, device=device),
                                     torch.full((2,), 4.0, dtype=torch.float64, device=device)), 1)
    x = q.sample((200_000,))
    lw32, x32 = (p.log_prob(x) - q.log_prob(x)).float(), x.float()
    lnw, ess, logz, mean, var = fused_ops.snis(lw32, x32, moments=True)
    lw, x = lw32.double(), x32.double()  # plain float64 code on the same values
    w64 = torch.softmax(lw, 0)
    want_mean = (w64[:, None] * x).sum(0)
    want_var = (w64[:, None] * (x - want_mean) ** 2).sum(0)
    torch.testing.assert_close(lnw.double(), lw - torch.logsumexp(lw, 0), rtol=2**-24, atol=1e-6)
    torch.testing.assert_close(ess.double(), 1 / (w64**2).sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(logz.double(), torch.logsumexp(lw, 0) - math.log(x.shape[0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(mean.double(), want_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(var.double(), want_var, rtol=1e-6, atol=1e-6)
    pi = torch.softmax(logits, 0)
    true_mean = (pi[:, None] * means).sum(0)
    true_var = (pi[:, None] * (stds**2 + means**2)).sum(0) - true_mean**2
    assert abs(logz.item()) < 0.05
    torch.testing.assert_close(mean.double(), true_mean, rtol=0, atol=0.1)
    torch.testing.assert_close(var.double(), true_var, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_optional_outputs_are_empty(device):
    lw = torch.randn(4, 9, device=device)
    x = torch.randn(4, 9, 3, device=device)
    out = fused_ops.snis(lw)
    assert [tuple(t.shape) for t in out] == [(4, 9), (4,), (4,), (0,), (0,)]
    out_x = fused_ops.snis(lw, x)
    assert [tuple(t.shape) for t in out_x] == [(4, 9), (4,), (4,), (4, 3), (0,)]
    for a, b in zip(out[:3], out_x[:3]):
        assert torch.equal(a, b)
    full = fused_ops.snis(lw, x, moments=True)
    assert torch.equal(full[3], out_x[3])
    # Gradients through a call without samples, and with samples but no moments.
    lw.requires_grad_()
    g = torch.autograd.grad(fused_ops.snis(lw)[1].sum(), lw)[0]
    g_ref = torch.autograd.grad(reference.snis(lw)[1].sum(), lw)[0]
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)
    x.requires_grad_()
    gx = torch.autograd.grad(fused_ops.snis(lw, x)[3].square().sum(), (lw, x))
    gx_ref = torch.autograd.grad(reference.snis(lw, x)[3].square().sum(), (lw, x))
    for a, b in zip(gx, gx_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("shape", [(64, 700), (3, 5, 20000)], ids=["B64-N700", "B3x5-N20000"])
def test_batched_equals_looped(shape, device):
    lw = torch.randn(*shape, device=device) * 3
    x = torch.randn(*shape, 4, device=device)
    batched = fused_ops.snis(lw, x, True)
    flat_lw, flat_x = lw.reshape(-1, shape[-1]), x.reshape(-1, shape[-1], 4)
    looped = [fused_ops.snis(flat_lw[i], flat_x[i], True) for i in range(flat_lw.shape[0])]
    for k, name in enumerate(("log_norm_weights", "ess", "log_evidence", "mean", "variance")):
        want = torch.stack([o[k] for o in looped]).reshape(batched[k].shape)
        if torch.device(device).type == "cpu":
            # The CPU chunks each problem the same way alone and in a batch.
            assert torch.equal(batched[k], want), name
        else:
            torch.testing.assert_close(batched[k], want, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("offset", [1000.0, -3000.0, 80000.0])
def test_log_weights_in_the_thousands(offset, device):
    # exp(lw) over- or underflows in any dtype; the outputs do not move.
    base = torch.randn(3, 5000, device=device, dtype=torch.float64) * 2
    x = torch.randn(3, 5000, 2, device=device)
    lw = (base + offset).float()
    got = fused_ops.snis(lw, x, True)
    exact = reference.snis(lw.double() - offset, x.double(), True)
    torch.testing.assert_close(got[0].double(), exact[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1].double(), exact[1], rtol=1e-5, atol=0)
    torch.testing.assert_close(got[2].double() - offset, exact[2], rtol=0, atol=abs(offset) * 2**-22 + 1e-5)
    for k in (3, 4):
        torch.testing.assert_close(got[k].double(), exact[k], rtol=1e-5, atol=1e-5)
    assert all(torch.isfinite(t).all() for t in got)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_minus_inf_weights_are_zero_weights(device):
    # -inf weights drop out: the result on the rest is unchanged, their
    # normalised log weights are -inf and their gradients carry nothing.
    lw = torch.randn(2, 20000, device=device, dtype=torch.float64)
    x = torch.randn(2, 20000, 3, device=device, dtype=torch.float64)
    keep = torch.rand(20000, device=device) < 0.5
    lw_masked = lw.masked_fill(~keep, -math.inf)
    got = fused_ops.snis(lw_masked, x, True)
    want = fused_ops.snis(lw[:, keep], x[:, keep], True)
    assert torch.isneginf(got[0][:, ~keep]).all()
    torch.testing.assert_close(got[0][:, keep], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=0)
    n_all, n_kept = 20000, int(keep.sum())
    torch.testing.assert_close(got[2], want[2] + math.log(n_kept / n_all), rtol=1e-12, atol=1e-12)
    for k in (3, 4):
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)
    lw_masked.requires_grad_()
    x.requires_grad_()
    g_lw, g_x = torch.autograd.grad(sum(o.sum() for o in fused_ops.snis(lw_masked, x, True)[1:]), (lw_masked, x))
    assert torch.isfinite(g_lw).all() and torch.isfinite(g_x).all()
    assert (g_lw[:, ~keep] == 0).all() and (g_x[:, ~keep] == 0).all()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("n", [7, 30000])
def test_all_minus_inf_nan_and_plus_inf(n, device):
    # Per problem: all -inf -> evidence -inf (Z = 0), NaN elsewhere; a NaN or
    # +inf weight -> NaN everywhere; the other problems are untouched.
    lw = torch.randn(4, n, device=device)
    x = torch.randn(4, n, 2, device=device)
    lw[0] = -math.inf
    lw[1, n // 2] = math.nan
    lw[2, n - 1] = math.inf
    lnw, ess, logz, mean, var = fused_ops.snis(lw, x, True)
    sync(device)
    assert torch.isneginf(logz[0]) and torch.isnan(lnw[0]).all() and torch.isnan(ess[0])
    assert torch.isnan(mean[0]).all() and torch.isnan(var[0]).all()
    for b in (1, 2):
        assert torch.isnan(logz[b]) and torch.isnan(lnw[b]).all() and torch.isnan(ess[b])
        assert torch.isnan(mean[b]).all() and torch.isnan(var[b]).all()
    clean = fused_ops.snis(lw[3:], x[3:], True)
    for a, b in zip((lnw, ess, logz, mean, var), clean):
        torch.testing.assert_close(a[3:], b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_zero_dimensional_samples(device):
    lw = torch.randn(5, 10, device=device)
    out = fused_ops.snis(lw, torch.empty(5, 10, 0, device=device), True)
    assert out[3].shape == (5, 0) and out[4].shape == (5, 0)
    assert torch.equal(out[0], fused_ops.snis(lw)[0])
