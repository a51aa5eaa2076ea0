"""vae_elbo's reconstruction likelihoods other than the default Bernoulli
(``likelihood=``: Bernoulli from logits, Gaussian with a sigmoid or an
identity mean), each against the PyTorch expression it replaces in float32
and float64 with the gradients of every input; gradcheck; the op's own
contract for a non-default code (opcheck, fake, compile, bad codes with the
same message on the CPU and at trace time); the CUDA path rule (only the
cublas and general forward paths compute them; both backward paths do); a Gaussian VAE
built from the user's layers, trained against the same model trained by
plain PyTorch; and the Gaussian with a learned per-dimension log-variance
(``dec_logvar``) against ``Normal.log_prob``.  The default likelihood is the op table's
(op_table/vae_elbo.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_ops
from fused_ops import _paths
from fused_ops.ops import LIKELIHOODS
from fused_test_utils import DTYPES, requires_cuda, tol
from op_cases import VAE_ELBO, vae_assert_grads_close, vae_clear_of_relu_kinks, vae_gradcheck_inputs

OTHERS = [name for name in LIKELIHOODS if name != "bernoulli"]
NAMES = VAE_ELBO.arg_names


def reference(x, eps, we, be, wm, bm, wl, bl, w1, b1, w2, b2, likelihood):
    """(elbo, recon, kl) as a user writes them for ``likelihood``."""
    h = torch.relu(F.linear(x, we, be))
    mu, logvar = F.linear(h, wm, bm), F.linear(h, wl, bl)
    z = mu + torch.exp(0.5 * logvar) * eps
    a = F.linear(torch.relu(F.linear(z, w1, b1)), w2, b2)
    terms = {
        "bernoulli": lambda: F.binary_cross_entropy(torch.sigmoid(a), x, reduction="none"),
        "bernoulli_logits": lambda: F.binary_cross_entropy_with_logits(a, x, reduction="none"),
        "gaussian_sigmoid": lambda: F.mse_loss(torch.sigmoid(a), x, reduction="none"),
        "gaussian": lambda: F.mse_loss(a, x, reduction="none"),
    }
    recon = terms[likelihood]().sum(-1)
    kl = -0.5 * (1 + logvar - mu**2 - torch.exp(logvar)).sum(-1)
    return -(recon + kl), recon, kl


def _inputs(size, dtype, device, likelihood):
    """Op inputs; Gaussian targets are real numbers (not probabilities)."""
    def make():
        args = VAE_ELBO.inputs(size, dtype=dtype, device=device)
        if likelihood == "gaussian":
            args[0] = torch.randn_like(args[0]) * 2
        return [t.requires_grad_() for t in args]
    return make() if dtype == torch.float64 else vae_clear_of_relu_kinks(make)


def _loss(outputs):
    elbo, recon, kl = outputs
    return elbo.sum() + 0.7 * recon.sum() - 0.2 * kl.sum()


@pytest.mark.parametrize("likelihood", list(LIKELIHOODS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("size", [(37, 50, 13, 4), (130, 784, 256, 32)], ids=["B37", "B130-784"])
def test_matches_pytorch_expression(size, dtype, likelihood, device):
    args = _inputs(size, dtype, device, likelihood)
    got = fused_ops.vae_elbo(*args, likelihood=likelihood)
    want = reference(*args, likelihood)
    for name, g, w in zip(("elbo", "recon", "kl"), got, want):
        torch.testing.assert_close(g, w, **tol(dtype), msg=lambda m, n=name: f"{n}: {m}")
    got_grads = torch.autograd.grad(_loss(got), args)
    want_grads = torch.autograd.grad(_loss(want), args)
    if dtype == torch.float64:
        vae_assert_grads_close(NAMES, got_grads, want_grads, rtol=1e-10, atol_scale=1e-12)
    else:
        vae_assert_grads_close(NAMES, got_grads, want_grads)


@pytest.mark.parametrize("likelihood", OTHERS)
def test_gradcheck(likelihood, device):
    args = vae_gradcheck_inputs(VAE_ELBO, (3, 5, 7, 3), device)
    if likelihood == "gaussian":
        with torch.no_grad():
            args[0].copy_(torch.randn_like(args[0]))
    torch.autograd.gradcheck(lambda *a: fused_ops.vae_elbo(*a, likelihood=likelihood), args,
                             eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("likelihood", OTHERS)
def test_targets_outside_unit_interval_are_accepted(likelihood):
    # Only binary_cross_entropy requires probabilities as targets.
    args = VAE_ELBO.inputs((4, 6, 5, 3))
    args[0] = args[0] * 3 - 1
    for g, w in zip(fused_ops.vae_elbo(*args, likelihood=likelihood), reference(*args, likelihood)):
        torch.testing.assert_close(g, w, **tol(torch.float32))


def test_bad_likelihood():
    args = VAE_ELBO.inputs((4, 6, 5, 3))
    with pytest.raises(ValueError, match=r"likelihood must be one of 'bernoulli'.*got 'poisson'"):
        fused_ops.vae_elbo(*args, likelihood="poisson")
    message = r"likelihood must be 0 \(Bernoulli\), 1 .* or 3 \(Gaussian, mean = logits\), got {}$"
    for device in ("cpu", "meta"):  # the kernel's check and the fake's
        on = [t.to(device) for t in args]
        ups = [torch.ones(4, device=device)] * 3
        for code in (7, -1, 4):
            with pytest.raises(RuntimeError, match=message.format(code)):
                torch.ops.fused_ops.vae_elbo(*on, code)
            with pytest.raises(RuntimeError, match=message.format(code)):
                torch.ops.fused_ops.vae_elbo_backward(*ups, *on, code)
            with pytest.raises(RuntimeError, match=message.format(code)):
                torch.ops.fused_ops.vae_elbo_train(*on, code)


@pytest.mark.parametrize("likelihood", OTHERS)
def test_opcheck(likelihood):
    code = LIKELIHOODS[likelihood]
    args = VAE_ELBO.inputs((6, 5, 7, 3), requires_grad=True)
    torch.library.opcheck(torch.ops.fused_ops.vae_elbo.default, (*args, code))
    torch.library.opcheck(torch.ops.fused_ops.vae_elbo_train.default, (*args, code))
    ups = [torch.randn(6) for _ in range(3)]
    plain = [t.detach() for t in args]
    torch.library.opcheck(torch.ops.fused_ops.vae_elbo_backward.default, (*ups, *plain, code))


def test_compile_fullgraph():
    args = _inputs((9, 8, 6, 3), torch.float32, "cpu", "gaussian")
    fn = lambda *a: _loss(fused_ops.vae_elbo(*a, likelihood="gaussian"))  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    got, want = compiled(*args), fn(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(torch.autograd.grad(got, args), torch.autograd.grad(want, args)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("likelihood", OTHERS)
@pytest.mark.parametrize("bwd_path", ["persistent", "cublas"])
def test_cuda_paths(likelihood, bwd_path):
    """The forward takes the cublas path at B >= 2048 (the tensor-core and
    cluster paths compute the Bernoulli term only, and refuse when forced);
    both backward paths."""
    args32 = VAE_ELBO.inputs((2048, 784, 256, 32), device="cuda")  # where wgmma, tiled, cluster all apply
    for path in ("wgmma", "tiled", "cluster"):
        with _paths.force("vae_elbo", path):
            fused_ops.vae_elbo(*args32)
            with pytest.raises(RuntimeError, match=path):
                fused_ops.vae_elbo(*args32, likelihood=likelihood)
    got32 = fused_ops.vae_elbo(*args32, likelihood=likelihood)
    assert _paths.last("vae_elbo") == "cublas"
    for g, w in zip(got32, reference(*args32, likelihood)):
        torch.testing.assert_close(g, w, **tol(torch.float32))
    args = _inputs((128, 784, 256, 32), torch.float64, "cuda", likelihood)
    with _paths.force("vae_elbo_backward", bwd_path):
        got = fused_ops.vae_elbo(*args, likelihood=likelihood)
        got_grads = torch.autograd.grad(_loss(got), args)
        assert _paths.last("vae_elbo_backward") == bwd_path
    want = reference(*args, likelihood)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    vae_assert_grads_close(NAMES, got_grads, torch.autograd.grad(_loss(want), args), rtol=1e-10,
                           atol_scale=1e-12)


class GaussianVAE(nn.Module):
    """A user's Gaussian VAE: linear decoder output as the mean, MSE summed."""

    def __init__(self, i, h, l_):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(i, h), nn.ReLU())
        self.fc_mu, self.fc_logvar = nn.Linear(h, l_), nn.Linear(h, l_)
        self.decoder = nn.Sequential(nn.Linear(l_, h), nn.ReLU(), nn.Linear(h, i))

    def loss(self, x, eps):
        h = self.encoder(x)
        mu, logvar = self.fc_mu(h), self.fc_logvar(h)
        recon_x = self.decoder(mu + torch.exp(0.5 * logvar) * eps)
        mse = F.mse_loss(recon_x, x, reduction="sum")
        return mse - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())


@pytest.mark.parametrize("sigmoid", [False, True], ids=["identity_mean", "sigmoid_mean"])
def test_gaussian_vae_training_curve(sigmoid, device):
    torch.manual_seed(0)
    model = GaussianVAE(40, 24, 4).to(device)
    if sigmoid:
        model.decoder.append(nn.Sigmoid())
    mine = copy.deepcopy(model)
    fused = fused_ops.nn.VAE.from_modules(mine.encoder, mine.fc_mu, mine.fc_logvar, mine.decoder,
                                          likelihood="gaussian")
    opt_ref = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = torch.optim.Adam(mine.parameters(), lr=1e-3)
    want, got = [], []
    x = torch.rand(32, 40, device=device) if sigmoid else torch.randn(32, 40, device=device)
    for _ in range(15):  # one batch, fresh noise: the loss must go down
        eps = torch.randn(32, 4, device=device)
        for module_opt, loss, out in ((opt_ref, model.loss(x, eps), want), (opt, -fused(x, eps)[0].sum(), got)):
            module_opt.zero_grad()
            loss.backward()
            module_opt.step()
            out.append(loss.item())
    assert want[-1] < want[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    recon_x = fused.forward_with_outputs(x, eps)[3]
    with torch.no_grad():
        h = mine.encoder(x)
        expected = mine.decoder(mine.fc_mu(h) + torch.exp(0.5 * mine.fc_logvar(h)) * eps)
    torch.testing.assert_close(recon_x, expected, **tol(torch.float32))


def test_from_modules_likelihood_names():
    enc, mu, lv = nn.Sequential(nn.Linear(6, 4), nn.ReLU()), nn.Linear(4, 2), nn.Linear(4, 2)
    for decoder, likelihood, code in (
        (nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 6), nn.Sigmoid()), "bernoulli", "bernoulli"),
        (nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 6)), "bernoulli", "bernoulli_logits"),
        (nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 6), nn.Sigmoid()), "gaussian", "gaussian_sigmoid"),
        (nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 6)), "gaussian", "gaussian"),
    ):
        fused = fused_ops.nn.VAE.from_modules(enc, mu, lv, decoder, likelihood=likelihood)
        x, eps = torch.rand(3, 6), torch.randn(3, 2)
        weights = [p for m in (enc[0], mu, lv, decoder[0], decoder[2]) for p in (m.weight, m.bias)]
        for g, w in zip(fused(x, eps), fused_ops.vae_elbo(x, eps, *weights, likelihood=code)):
            assert torch.equal(g, w)
    with pytest.raises(ValueError, match=r"likelihood must be 'bernoulli' or 'gaussian', got 'poisson'"):
        fused_ops.nn.VAE.from_modules(enc, mu, lv, decoder, likelihood="poisson")


def _gaussian_nll_reference(args, dec_logvar):
    """(elbo, recon, kl) with recon = -Normal(a, exp(0.5 dec_logvar)).log_prob(x).sum(-1)."""
    x, eps, we, be, wm, bm, wl, bl, w1, b1, w2, b2 = args
    h = torch.relu(F.linear(x, we, be))
    mu, logvar = F.linear(h, wm, bm), F.linear(h, wl, bl)
    a = F.linear(torch.relu(F.linear(mu + torch.exp(0.5 * logvar) * eps, w1, b1)), w2, b2)
    recon = -torch.distributions.Normal(a, torch.exp(0.5 * dec_logvar)).log_prob(x).sum(-1)
    kl = -0.5 * (1 + logvar - mu**2 - torch.exp(logvar)).sum(-1)
    return -(recon + kl), recon, kl


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_learned_variance_matches_normal_log_prob(dtype, device):
    args = _inputs((37, 50, 13, 4), dtype, device, "gaussian")
    dec_logvar = (torch.randn(50, dtype=dtype, device=device) * 0.5).requires_grad_()
    got = fused_ops.vae_elbo(*args, likelihood="gaussian", dec_logvar=dec_logvar)
    want = _gaussian_nll_reference(args, dec_logvar)
    for name, g, w in zip(("elbo", "recon", "kl"), got, want):
        torch.testing.assert_close(g, w, **tol(dtype), msg=lambda m, n=name: f"{n}: {m}")
    inputs = [*args, dec_logvar]
    got_grads = torch.autograd.grad(_loss(got), inputs)
    want_grads = torch.autograd.grad(_loss(want), inputs)
    names = (*NAMES, "dec_logvar")
    if dtype == torch.float64:
        vae_assert_grads_close(names, got_grads, want_grads, rtol=1e-10, atol_scale=1e-12)
    else:
        vae_assert_grads_close(names, got_grads, want_grads)
    recon_x = fused_ops.vae_elbo(*args, likelihood="gaussian", dec_logvar=dec_logvar, return_outputs=True)[3]
    plain = fused_ops.vae_elbo(*args, likelihood="gaussian", return_outputs=True)[3]
    torch.testing.assert_close(recon_x, plain, **tol(dtype))  # the mean, unscaled


def test_learned_variance_refused():
    args = VAE_ELBO.inputs((4, 6, 5, 3))
    with pytest.raises(ValueError, match=r"dec_logvar .* needs likelihood='gaussian'"):
        fused_ops.vae_elbo(*args, dec_logvar=torch.zeros(6))
    with pytest.raises(ValueError, match=r"dec_logvar must be a 1-D tensor \[I\].*got \[5\]"):
        fused_ops.vae_elbo(*args, likelihood="gaussian", dec_logvar=torch.zeros(5))
    with pytest.raises(ValueError, match=r"dec_logvar must have x's dtype"):
        fused_ops.vae_elbo(*args, likelihood="gaussian", dec_logvar=torch.zeros(6, dtype=torch.float64))
    enc, mu, lv = nn.Sequential(nn.Linear(6, 4), nn.ReLU()), nn.Linear(4, 2), nn.Linear(4, 2)
    sig = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 6), nn.Sigmoid())
    with pytest.raises(ValueError, match=r"without Sigmoid"):
        fused_ops.nn.VAE.from_modules(enc, mu, lv, sig, likelihood="gaussian", dec_logvar=nn.Parameter(torch.zeros(6)))
    with pytest.raises(ValueError, match=r"dec_logvar must be an nn.Parameter \[I\] \(I = 6"):
        fused_ops.nn.VAE.from_modules(enc, mu, lv, sig[:3], likelihood="gaussian",
                                      dec_logvar=nn.Parameter(torch.zeros(5)))


def test_learned_variance_module_trains_the_users_parameter(device):
    torch.manual_seed(0)
    model = GaussianVAE(30, 16, 3).to(device)
    model.dec_logvar = nn.Parameter(torch.zeros(30, device=device))
    fused = fused_ops.nn.VAE.from_modules(model.encoder, model.fc_mu, model.fc_logvar, model.decoder,
                                          likelihood="gaussian", dec_logvar=model.dec_logvar)
    assert fused.dec_logvar is model.dec_logvar and "dec_logvar" in fused.state_dict()
    x, eps = torch.randn(16, 30, device=device), torch.randn(16, 3, device=device)
    args = [x, eps, *(p for m in (model.encoder[0], model.fc_mu, model.fc_logvar, model.decoder[0],
                                   model.decoder[2]) for p in (m.weight, m.bias))]
    params = list(model.parameters())
    got = torch.autograd.grad(-fused(x, eps)[0].sum(), params)
    want = torch.autograd.grad(-_gaussian_nll_reference(args, model.dec_logvar)[0].sum(), params)
    vae_assert_grads_close([n for n, _ in model.named_parameters()], got, want)
    assert got[-1].abs().max() > 0  # dec_logvar's gradient reaches the user's parameter
