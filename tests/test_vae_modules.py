"""fused_ops.nn.VAE on the VAEs users write: pytorch/examples' model
(fc1/fc21/fc22/fc3/fc4, BCE summed + KLD) end to end -- loss, gradients, a
short Adam training curve, checkpoints -- the user's own layers
(``from_modules``), the inputs' shapes (``[B, 1, 28, 28]``), the decoder's
probabilities, mu and logvar (``forward_with_outputs`` and
``vae_elbo(..., return_outputs=True)``), and the layouts refused, each with
an error naming the layer.  Each against the plain PyTorch program it
replaces (fused_ops.reference.ExamplesVAE and examples_loss_function, the
reference VAE)."""

import copy

import pytest
import torch
from torch import nn

import fused_ops
from fused_ops import reference
from fused_ops.nn import VAE
from fused_test_utils import DTYPES, tol
from op_cases import vae_assert_grads_close, vae_preactivations

DTYPE_IDS = ["f32", "f64"]


def _examples_model(dtype, device, sizes=(784, 400, 20)):
    return reference.ExamplesVAE(*sizes).to(device=device, dtype=dtype)


def _examples_loss(model, x, eps):
    """The example's loss_function of the example's forward."""
    recon_x, mu, logvar = model(x, eps)
    return reference.examples_loss_function(recon_x, x, mu, logvar)


def _op_args(fused, x, eps):
    """The op's 12 tensors of a fused module's call on x (flattened), eps."""
    from fused_ops.nn import _linear_params, _submodules

    return (x.reshape(x.shape[0], -1), eps, *_linear_params(_submodules(fused, fused._linear_paths)))


def _clear_draw(fused, shape, latent, dtype, device, margin=2e-5, tries=50):
    """(x, eps) whose ReLU inputs are all ``margin`` away from 0 (float32
    gradients cannot be compared across a kink: op_table/vae_elbo.py)."""
    for _ in range(tries):
        x = torch.rand(shape, dtype=dtype, device=device)
        eps = torch.randn(shape[0], latent, dtype=dtype, device=device)
        pre_enc, pre_dec, _ = vae_preactivations(_op_args(fused, x, eps))
        if dtype == torch.float64 or min(pre_enc.abs().min().item(), pre_dec.abs().min().item()) > margin:
            return x, eps
    raise AssertionError("no draw kept the ReLU inputs off their kinks")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_examples_loss_and_gradients(dtype, device):
    model = _examples_model(dtype, device)
    fused = VAE.from_pytorch_examples(model)
    x, eps = _clear_draw(fused, (24, 1, 28, 28), 20, dtype, device)
    params = list(model.parameters())
    want = _examples_loss(model, x, eps)
    want_grads = torch.autograd.grad(want, params)
    got = -fused(x, eps)[0].sum()
    got_grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, want, **tol(dtype))
    names = [n for n, _ in model.named_parameters()]
    if dtype == torch.float64:
        for n, g, w in zip(names, got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m, n=n: f"grad {n}: {m}")
    else:
        vae_assert_grads_close(names, got_grads, want_grads)


def test_examples_seeded_call_draws_what_the_example_draws(device):
    model = _examples_model(torch.float32, device, (30, 12, 4))
    fused = VAE.from_pytorch_examples(model)
    x = torch.rand(9, 5, 6, device=device)
    torch.manual_seed(3)
    recon_x, mu, logvar = model(x)
    after = torch.rand(2, device=device)
    torch.manual_seed(3)
    elbo, recon, kl, probs, got_mu, got_logvar = fused.forward_with_outputs(x)
    assert torch.equal(torch.rand(2, device=device), after)
    f32 = tol(torch.float32)
    torch.testing.assert_close(-elbo.sum(), reference.examples_loss_function(recon_x, x, mu, logvar), **f32)
    torch.testing.assert_close(probs, recon_x.view(x.shape), **f32)
    torch.testing.assert_close(got_mu, mu, **f32)
    torch.testing.assert_close(got_logvar, logvar, **f32)


def test_examples_training_curve(device):
    """20 Adam steps (lr 1e-3, the example's) of the example's model through
    its own loss and of a copy through the fused module, the copy's
    optimiser built on the copy's parameters: the fused module trains the
    user's parameters, and the curves agree."""
    torch.manual_seed(0)
    model = _examples_model(torch.float32, device, (196, 64, 8))
    mine = copy.deepcopy(model)
    fused = VAE.from_pytorch_examples(mine)
    opt_ref = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = torch.optim.Adam(mine.parameters(), lr=1e-3)
    want, got = [], []
    x = torch.rand(32, 1, 14, 14, device=device)
    for _ in range(20):  # one batch, fresh noise: the loss must go down
        eps = torch.randn(32, 8, device=device)
        loss = _examples_loss(model, x, eps)
        opt_ref.zero_grad()
        loss.backward()
        opt_ref.step()
        want.append(loss.item())
        loss = -fused(x, eps)[0].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        got.append(loss.item())
    assert want[-1] < want[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    for name, p in mine.named_parameters():
        torch.testing.assert_close(p, dict(model.named_parameters())[name], rtol=1e-4, atol=1e-5)


def test_examples_state_dict_round_trip():
    model = _examples_model(torch.float32, "cpu", (20, 8, 3))
    fused = VAE.from_pytorch_examples(model)
    assert list(fused.state_dict()) == list(model.state_dict())
    assert fused.fc1.weight is model.fc1.weight  # shared, not copied
    other = reference.ExamplesVAE(20, 8, 3)
    fused.load_state_dict(other.state_dict(), strict=True)  # the user's checkpoint into the fused module
    assert torch.equal(model.fc4.bias, other.fc4.bias)
    again = reference.ExamplesVAE(20, 8, 3)
    again.load_state_dict(fused.state_dict(), strict=True)
    x, eps = torch.rand(5, 20), torch.randn(5, 3)
    for g, w in zip(VAE.from_pytorch_examples(again)(x, eps), fused(x, eps)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("flatten", [False, True], ids=["plain", "flatten"])
def test_from_modules_matches_reference(flatten, dtype, device):
    ref = reference.VAE(48, 16, 5).to(device=device, dtype=dtype)
    encoder = nn.Sequential(nn.Flatten(), *ref.encoder) if flatten else ref.encoder
    fused = VAE.from_modules(encoder, ref.fc_mu, ref.fc_logvar, ref.decoder)
    assert fused.fc_mu.weight is ref.fc_mu.weight
    if not flatten:
        assert list(fused.state_dict()) == list(ref.state_dict())
    x, eps = _clear_draw(fused, (7, 48), 5, dtype, device)
    shaped = x.view(7, 3, 4, 4) if flatten else x
    params = list(ref.parameters())
    want = ref(x, eps)
    got = fused(shaped, eps)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol(dtype))
    loss = lambda o: o[0].sum() + 0.3 * o[1].sum() - o[2].sum()  # noqa: E731
    names = [n for n, _ in ref.named_parameters()]
    vae_assert_grads_close(names, torch.autograd.grad(loss(got), params), torch.autograd.grad(loss(want), params),
                           **({"rtol": 1e-10, "atol_scale": 1e-12} if dtype == torch.float64 else {}))


def test_input_shapes():
    fused = VAE(784, 32, 4)
    x, eps = torch.rand(6, 1, 28, 28), torch.randn(6, 4)
    flat = fused(x.view(6, 784), eps)
    for g, w in zip(fused(x, eps), flat):
        assert g.shape == (6,)
        assert torch.equal(g, w)
    # [..., I]: the reference's batch shapes.
    batched = fused(x.view(2, 3, 784), eps.view(2, 3, 4))
    assert all(t.shape == (2, 3) for t in batched)
    for bad in ((6, 28), (6, 1, 28, 27), (28,)):
        with pytest.raises(ValueError, match=r"x must be \[\.\.\., 784\] or \[B, \.\.\.\].*encoder\.0\.in_features"):
            fused(torch.rand(bad), None)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_return_outputs(dtype, device):
    ref = reference.VAE(40, 24, 6).to(device=device, dtype=dtype)
    fused = VAE.from_reference(ref)
    x, eps = torch.rand(11, 40, dtype=dtype, device=device), torch.randn(11, 6, dtype=dtype, device=device)
    args = _op_args(fused, x, eps)
    plain = fused_ops.vae_elbo(*args)
    elbo, recon, kl, probs, mu, logvar = fused_ops.vae_elbo(*args, return_outputs=True)
    for g, w in zip((elbo, recon, kl), plain):
        assert torch.equal(g, w)  # the same kernel's losses
    with torch.no_grad():
        h = ref.encoder(x)
        want_mu, want_logvar = ref.fc_mu(h), ref.fc_logvar(h)
        want_probs = ref.decoder(want_mu + torch.exp(0.5 * want_logvar) * eps)
    for name, g, w in (("probs", probs, want_probs), ("mu", mu, want_mu), ("logvar", logvar, want_logvar)):
        assert not g.requires_grad and g.is_contiguous(), name
        torch.testing.assert_close(g, w, **tol(dtype), msg=lambda m, n=name: f"{n}: {m}")
    # Gradients through the losses are those of the call without outputs.
    grads = torch.autograd.grad(fused_ops.vae_elbo(*args, return_outputs=True)[0].sum(), list(ref.parameters()))
    want = torch.autograd.grad(fused_ops.vae_elbo(*args)[0].sum(), list(ref.parameters()))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_forward_with_outputs_under_compile():
    fused = VAE(12, 8, 3)
    x, eps = torch.rand(5, 1, 3, 4), torch.randn(5, 3)
    compiled = torch.compile(fused.forward_with_outputs, fullgraph=True)
    for g, w in zip(compiled(x, eps), fused.forward_with_outputs(x, eps)):
        torch.testing.assert_close(g, w, **tol(torch.float32))


def _enc(i, h):
    return nn.Sequential(nn.Linear(i, h), nn.ReLU())


def _dec(l_, h, i):
    return nn.Sequential(nn.Linear(l_, h), nn.ReLU(), nn.Linear(h, i), nn.Sigmoid())


# (id, parts of from_modules, expected message)
FROM_MODULES_REFUSED = [
    ("tanh_then_relu", lambda: (nn.Sequential(nn.Linear(9, 6), nn.Tanh()), nn.Linear(6, 2), nn.Linear(6, 2),
                                _dec(2, 6, 9)), r"decoder\[1\] is ReLU\(\): the layers before apply tanh"),
    ("leaky_slopes", lambda: (nn.Sequential(nn.Linear(9, 6), nn.LeakyReLU(0.1)), nn.Linear(6, 2), nn.Linear(6, 2),
                              nn.Sequential(nn.Linear(2, 6), nn.LeakyReLU(0.2), nn.Linear(6, 9))),
     r"decoder\[1\] is LeakyReLU.*apply leaky_relu\(0\.1"),
    ("softsign", lambda: (nn.Sequential(nn.Linear(9, 6), nn.Softsign()), nn.Linear(6, 2), nn.Linear(6, 2),
                          _dec(2, 6, 9)), r"encoder\[1\] is Softsign: expected an activation layer"),
    ("joint_head_odd", lambda: (_enc(9, 6), nn.Linear(6, 5), None, _dec(2, 6, 9)), r"fc_mu alone .* 5 outputs"),
    ("joint_head_width", lambda: (_enc(9, 6), nn.Linear(6, 4), None, _dec(3, 6, 9)),
     r"decoder\[0\] must be Linear\(2, "),
    ("deep_encoder_width", lambda: (nn.Sequential(nn.Linear(9, 6), nn.ReLU(), nn.Linear(5, 4), nn.ReLU()),
                                    nn.Linear(4, 2), nn.Linear(4, 2), _dec(2, 6, 9)),
     r"encoder\[2\] must be Linear\(6, 4\)"),
    ("silu_decoder", lambda: (_enc(9, 6), nn.Linear(6, 2), nn.Linear(6, 2),
                              nn.Sequential(nn.Linear(2, 6), nn.SiLU(), nn.Linear(6, 9), nn.Sigmoid())),
     r"decoder\[1\] is SiLU"),
    ("logvar_width", lambda: (_enc(9, 6), nn.Linear(6, 2), nn.Linear(6, 3), _dec(2, 6, 9)),
     r"fc_logvar must be Linear\(6, 2\).*got Linear\(6, 3\)"),
    ("mu_input", lambda: (_enc(9, 6), nn.Linear(5, 2), nn.Linear(6, 2), _dec(2, 6, 9)),
     r"fc_mu must be Linear\(6, 2\)"),
    ("decoder_chain", lambda: (_enc(9, 6), nn.Linear(6, 2), nn.Linear(6, 2),
                               nn.Sequential(nn.Linear(2, 7), nn.ReLU(), nn.Linear(6, 9))),
     r"decoder\[2\] must be Linear\(7, 9\)"),
    ("decoder_output", lambda: (_enc(9, 6), nn.Linear(6, 2), nn.Linear(6, 2), _dec(2, 6, 8)),
     r"decoder\[2\] must be Linear\(6, 9\)"),
    ("no_bias", lambda: (nn.Sequential(nn.Linear(9, 6, bias=False), nn.ReLU()), nn.Linear(6, 2), nn.Linear(6, 2),
                         _dec(2, 6, 9)), r"encoder\[0\] must have a bias"),
    ("five_hidden_layers", lambda: (nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(9, 9), nn.ReLU())]),
                                    nn.Linear(9, 2), nn.Linear(9, 2), _dec(2, 9, 9)),
     r"encoder must hold 1 to 4 .* got 10 layers"),
    ("decoder_five_hidden", lambda: (_enc(9, 6), nn.Linear(6, 2), nn.Linear(6, 2),
                                     nn.Sequential(nn.Linear(2, 6), nn.ReLU(),
                                                   *[m for _ in range(4) for m in (nn.Linear(6, 6), nn.ReLU())],
                                                   nn.Linear(6, 9))),
     r"decoder must be Sequential.* 1 to 4 hidden layers, got 11 layers"),
    ("no_output_layer", lambda: (_enc(9, 6), nn.Linear(6, 2), nn.Linear(6, 2), _dec(2, 6, 9)[:2]),
     r"decoder\[1\] is ReLU: the decoder must end in its output Linear"),
    ("tanh_output", lambda: (_enc(9, 6), nn.Linear(6, 2), nn.Linear(6, 2),
                             nn.Sequential(*_dec(2, 6, 9)[:3], nn.Tanh())), r"decoder\[3\] is Tanh"),
    ("encoder_linear_only", lambda: (nn.Linear(9, 6), nn.Linear(6, 2), nn.Linear(6, 2), _dec(2, 6, 9)),
     r"encoder must be nn.Sequential"),
    ("conv_head", lambda: (_enc(9, 6), nn.Conv1d(6, 2, 1), nn.Linear(6, 2), _dec(2, 6, 9)),
     r"fc_mu must be an nn.Linear"),
]


@pytest.mark.parametrize("parts,message", [pytest.param(p, m, id=i) for i, p, m in FROM_MODULES_REFUSED])
def test_from_modules_refuses(parts, message):
    with pytest.raises(ValueError, match=message):
        VAE.from_modules(*parts())


class _ExamplesWithExtras(reference.ExamplesVAE):
    def __init__(self, change):
        super().__init__(20, 8, 3)
        change(self)


EXAMPLES_REFUSED = {
    "missing_fc22": (lambda m: delattr(m, "fc22"), r"has no layer fc22"),
    "dropout": (lambda m: setattr(m, "drop", nn.Dropout(0.1)), r"\.drop \(Dropout\) is not part"),
    "extra_layer": (lambda m: setattr(m, "fc5", nn.Linear(20, 20)), r"\.fc5 \(Linear\) is not part"),
    "own_parameter": (lambda m: setattr(m, "beta", nn.Parameter(torch.ones(()))), r"\.beta is a parameter"),
    "fc22_width": (lambda m: setattr(m, "fc22", nn.Linear(8, 4)), r"fc22 must be Linear\(8, 3\)"),
    "fc4_output": (lambda m: setattr(m, "fc4", nn.Linear(8, 21)), r"fc4 must be Linear\(8, 20\)"),
    "fc3_no_bias": (lambda m: setattr(m, "fc3", nn.Linear(3, 8, bias=False)), r"fc3 must have a bias"),
}


@pytest.mark.parametrize("kind", list(EXAMPLES_REFUSED))
def test_from_pytorch_examples_refuses(kind):
    change, message = EXAMPLES_REFUSED[kind]
    with pytest.raises(ValueError, match=message):
        VAE.from_pytorch_examples(_ExamplesWithExtras(change))


def test_from_pytorch_examples_accepts_activation_children():
    model = reference.ExamplesVAE(20, 8, 3)
    model.relu, model.sigmoid = nn.ReLU(), nn.Sigmoid()
    fused = VAE.from_pytorch_examples(model)
    assert list(fused.state_dict()) == list(model.state_dict())
