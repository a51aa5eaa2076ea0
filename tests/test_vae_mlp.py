"""What vae_mlp_elbo has beyond its flat table rows (op_table/vae_mlp.py,
two hidden layers each side): depths 1 to 4 on either side, both head
layouts and every activation through the user's own ``nn.Sequential``
layers and the loss users write (float32 and float64, every parameter's
gradient), the learned per-feature log-variance against
``torch.distributions.Normal``, gradcheck and opcheck at depths the table
cannot express, the modules (``from_modules`` sharing parameters, the
constructor's layouts, state_dict round trips, the one-hidden-layer ReLU
layout staying on vae_elbo), and bad lists with their errors."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_ops
from fused_ops.nn import VAE
from fused_ops.ops import _vae_mlp
from fused_test_utils import DTYPES
from op_table.vae_mlp import reference

DTYPE_IDS = ["f32", "f64"]
_ACTS = {"relu": nn.ReLU, "leaky_relu": lambda: nn.LeakyReLU(0.2), "elu": lambda: nn.ELU(0.7), "silu": nn.SiLU,
         "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "tanh": nn.Tanh}
_SMOOTH = ("silu", "gelu", "gelu_tanh", "tanh", "elu")


def _mlp(widths, act, out=None, sigmoid=False):
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), _ACTS[act]()]
    if out is not None:
        layers.append(nn.Linear(widths[-1], out))
    if sigmoid:
        layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)


def _user_parts(i, enc, l_, dec, act, joint, sigmoid, dtype, device):
    """The user's layers: encoder MLP, head(s), decoder MLP (widths lists of hidden sizes)."""
    encoder = _mlp([i, *enc], act)
    fc_mu = nn.Linear(enc[-1], 2 * l_ if joint else l_)
    fc_logvar = None if joint else nn.Linear(enc[-1], l_)
    decoder = _mlp([l_, *dec], act, out=i, sigmoid=sigmoid)
    parts = [encoder, fc_mu, fc_logvar, decoder]
    return [p.to(device=device, dtype=dtype) if p is not None else None for p in parts]


def _user_loss(parts, x, eps, likelihood, dec_logvar=None):
    """The loss users write with their own layers: (elbo, recon, kl) per sample."""
    encoder, fc_mu, fc_logvar, decoder = parts
    h = encoder(x)
    mu, logvar = fc_mu(h).chunk(2, -1) if fc_logvar is None else (fc_mu(h), fc_logvar(h))
    out = decoder(mu + torch.exp(0.5 * logvar) * eps)
    if dec_logvar is not None:
        recon = -torch.distributions.Normal(out, torch.exp(0.5 * dec_logvar)).log_prob(x).sum(-1)
    elif likelihood == "bernoulli" and isinstance(decoder[-1], nn.Sigmoid):
        recon = F.binary_cross_entropy(out, x, reduction="none").sum(-1)
    elif likelihood == "bernoulli":  # a decoder ending in its Linear: logits
        recon = F.binary_cross_entropy_with_logits(out, x, reduction="none").sum(-1)
    else:
        recon = F.mse_loss(out, x, reduction="none").sum(-1)
    kl = -0.5 * (1 + logvar - mu**2 - torch.exp(logvar)).sum(-1)
    return -(recon + kl), recon, kl


def _params(parts, extra=()):
    return [p for m in parts if m is not None for p in m.parameters()] + list(extra)


# (encoder widths, decoder widths, activation, joint head, likelihood, decoder Sigmoid)
LAYOUTS = [
    ([9], [9], "silu", False, "gaussian", False),
    ([16, 8], [8, 16], "gelu", True, "gaussian", True),
    ([13, 11, 7], [5], "tanh", False, "bernoulli", True),
    ([12, 10, 8, 6], [6, 8, 10, 12], "elu", True, "bernoulli", False),
    ([7], [4, 6, 8, 10], "gelu_tanh", False, "gaussian", False),
    ([10, 6], [6, 10], "leaky_relu", False, "bernoulli", True),
    ([11], [11, 5], "relu", True, "gaussian", True),
]


def _layout_id(lay):
    enc, dec, act, joint, lik, sig = lay
    return f"enc{len(enc)}-dec{len(dec)}-{act}-{'joint' if joint else 'split'}-{lik}{'-sigmoid' if sig else ''}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[_layout_id(lay) for lay in LAYOUTS])
def test_user_layers_against_plain_pytorch(layout, dtype, device):
    enc, dec, act, joint, likelihood, sigmoid = layout
    i, l_, b = 20, 3, 70
    parts = _user_parts(i, enc, l_, dec, act, joint, sigmoid, dtype, device)
    fused = VAE.from_modules(*parts, likelihood=likelihood)
    assert fused._mlp is not None or (len(enc) == len(dec) == 1 and act == "relu" and not joint)
    x = torch.rand(b, i, dtype=dtype, device=device)
    eps = torch.randn(b, l_, dtype=dtype, device=device)
    got, want = fused(x, eps), _user_loss(parts, x, eps, likelihood)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)
    if dtype == torch.float32 and act not in _SMOOTH:
        return  # float32 gradients across a kink cannot be compared (op_table/vae_elbo.py)
    ups = [torch.randn(b, dtype=dtype, device=device) for _ in range(3)]
    params = _params(parts)
    g_fused = torch.autograd.grad(sum((o * u).sum() for o, u in zip(got, ups)), params)
    g_user = torch.autograd.grad(sum((o * u).sum() for o, u in zip(want, ups)), params)
    for k, (gf, gu) in enumerate(zip(g_fused, g_user)):
        scale = max(gu.abs().max().item(), 1.0)
        torch.testing.assert_close(gf, gu, rtol=tol["rtol"], atol=tol["atol"] * scale, msg=lambda m: f"param {k}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_learned_log_variance(dtype, device):
    parts = _user_parts(12, [10, 8], 3, [8, 10], "silu", True, False, dtype, device)
    dec_logvar = nn.Parameter(0.3 * torch.randn(12, dtype=dtype, device=device))
    fused = VAE.from_modules(*parts, likelihood="gaussian", dec_logvar=dec_logvar)
    x = torch.randn(40, 12, dtype=dtype, device=device)
    eps = torch.randn(40, 3, dtype=dtype, device=device)
    got, want = fused(x, eps), _user_loss(parts, x, eps, "gaussian", dec_logvar)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)
    params = _params(parts, [dec_logvar])
    for gf, gu in zip(torch.autograd.grad(got[0].sum(), params), torch.autograd.grad(want[0].sum(), params)):
        torch.testing.assert_close(gf, gu, rtol=tol["rtol"], atol=tol["atol"] * max(gu.abs().max().item(), 1.0))


def _op_inputs(i, enc, l_, dec, b, dtype=torch.float64, device="cpu", logvar=False):
    def lin(o, n):
        opts = dict(dtype=dtype, device=device)
        return [torch.randn(o, n, **opts) / n**0.5, 0.1 * torch.randn(o, **opts)]

    ew, eb, w = [], [], i
    for h in enc:
        a, c = lin(h, w)
        ew.append(a), eb.append(c)
        w = h
    wh, bh = lin(2 * l_, w)
    dw, db, w = [], [], l_
    for h in [*dec, i]:
        a, c = lin(h, w)
        dw.append(a), db.append(c)
        w = h
    x = torch.rand(b, i, dtype=dtype, device=device).clamp(0.01, 0.99)
    eps = torch.randn(b, l_, dtype=dtype, device=device)
    lv = 0.2 * torch.randn(i, dtype=dtype, device=device) if logvar else None
    return x, eps, ew, eb, wh, bh, dw, db, lv


@pytest.mark.parametrize("enc,dec,act,lik,logvar", [
    ([4], [3], 0, 1, False), ([5, 4, 3, 2], [2, 3, 4, 5], 6, 3, True), ([3, 4, 3], [4], 8, 2, False),
], ids=["depth1-silu-logits", "depth4-gelu_tanh-learned_variance", "depth3-tanh-gaussian_sigmoid"])
def test_gradcheck_depths(enc, dec, act, lik, logvar, device):
    x, eps, ew, eb, wh, bh, dw, db, lv = _op_inputs(6, enc, 2, dec, 5, device=device, logvar=logvar)
    flat = [x, eps, *ew, *eb, wh, bh, *dw, *db] + ([lv] if logvar else [])
    flat = [t.requires_grad_() for t in flat]
    ne, nd = len(ew), len(dw)

    def f(*t):
        it = iter(t)
        x, eps = next(it), next(it)
        ew_, eb_ = [next(it) for _ in range(ne)], [next(it) for _ in range(ne)]
        wh_, bh_ = next(it), next(it)
        dw_, db_ = [next(it) for _ in range(nd)], [next(it) for _ in range(nd)]
        lv_ = next(it) if logvar else None
        return fused_ops.vae_mlp_elbo(x, eps, ew_, eb_, wh_, bh_, dw_, db_, activation=act, likelihood=lik,
                                      dec_logvar=lv_)

    assert torch.autograd.gradcheck(f, tuple(flat), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("logvar", [False, True], ids=["plain", "learned_variance"])
def test_opcheck_depth4(logvar, device):
    x, eps, ew, eb, wh, bh, dw, db, lv = _op_inputs(7, [6, 5, 4, 3], 2, [3, 4, 5, 6], 9, dtype=torch.float32,
                                                    device=device, logvar=logvar)
    for t in [x, eps, *ew, *eb, wh, bh, *dw, *db] + ([lv] if logvar else []):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.fused_ops.vae_mlp_elbo.default,
                          (x, eps, ew, eb, wh, bh, dw, db, lv, 5, 0.0, 3 if logvar else 0))


def test_op_against_reference_depth4(device):
    args = _op_inputs(9, [8, 7, 6, 5], 3, [5, 6, 7, 8], 33, device=device)
    for act in (1, 2, 3):
        got = fused_ops.vae_mlp_elbo(*args[:8], activation=act, act_param=0.3, likelihood=3)
        want = reference(*args, act, 0.3, 3)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("logvar", [False, True], ids=["plain", "learned_variance"])
def test_backward_without_the_x_gradient(logvar, device):
    """grad_x=False: x's gradient is an empty tensor and every other gradient
    is the full call's, bit for bit; through autograd, an x that needs no
    gradient gets none and the parameters the same gradients as when it does."""
    x, eps, ew, eb, wh, bh, dw, db, lv = _op_inputs(13, [6, 5], 3, [5, 7], 11, device=device, logvar=logvar)
    ups = [torch.randn(x.shape[0], dtype=x.dtype, device=device) for _ in range(3)]
    scalars = (5, 0.0, 3 if logvar else 0)
    bwd = torch.ops.fused_ops.vae_mlp_elbo_backward.default
    full = bwd(*ups, x, eps, ew, eb, wh, bh, dw, db, lv, *scalars)
    part = bwd(*ups, x, eps, ew, eb, wh, bh, dw, db, lv, *scalars, False)
    assert full[0].shape == x.shape and part[0].numel() == 0
    assert len(part) == len(full)
    for a, b in zip(part[1:], full[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.library.opcheck(bwd, (*ups, x, eps, ew, eb, wh, bh, dw, db, lv, *scalars, False))

    params = [*ew, *eb, wh, bh, *dw, *db] + ([lv] if logvar else [])
    grads = []
    for x_needs_grad in (True, False):
        xg = x.clone().requires_grad_(x_needs_grad)
        ps = [p.clone().requires_grad_() for p in params]
        ne, nd = len(ew), len(dw)
        out = fused_ops.vae_mlp_elbo(xg, eps, ps[:ne], ps[ne:2 * ne], ps[2 * ne], ps[2 * ne + 1],
                                     ps[2 * ne + 2:2 * ne + 2 + nd], ps[2 * ne + 2 + nd:2 * ne + 2 + 2 * nd],
                                     activation=5, likelihood=scalars[2], dec_logvar=ps[-1] if logvar else None)
        (out[0].sum() + out[1].sum()).backward()
        assert (xg.grad is not None) == x_needs_grad
        grads.append([p.grad for p in ps])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_training_shares_the_users_parameters(device):
    torch.manual_seed(0)
    parts = _user_parts(20, [16, 8], 4, [8, 16], "silu", False, True, torch.float32, device)
    twin = copy.deepcopy(parts)
    fused = VAE.from_modules(*parts)
    opt_f = torch.optim.Adam(_params(parts), lr=1e-2)
    opt_u = torch.optim.Adam(_params(twin), lr=1e-2)
    before = parts[0][0].weight.detach().clone()
    for _ in range(10):
        x = torch.rand(32, 20, device=device)
        eps = torch.randn(32, 4, device=device)
        loss_f = -fused(x, eps)[0].sum()
        loss_u = -_user_loss(twin, x, eps, "bernoulli")[0].sum()
        torch.testing.assert_close(loss_f, loss_u, rtol=1e-4, atol=1e-3)
        opt_f.zero_grad(), opt_u.zero_grad()
        loss_f.backward(), loss_u.backward()
        opt_f.step(), opt_u.step()
    assert not torch.equal(parts[0][0].weight, before)  # the user's own layer moved
    for pf, pu in zip(_params(parts), _params(twin)):
        torch.testing.assert_close(pf, pu, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("head", ["split", "joint"])
def test_constructor_layouts_and_state_dict(head):
    torch.manual_seed(1)
    fused = VAE(30, [20, 10], 4, activation="gelu", head=head, likelihood="gaussian")
    assert fused._mlp is not None and fused._mlp.activation == "gelu"
    names = list(fused.state_dict())
    assert ("fc_logvar.weight" in names) == (head == "split")
    # Round trip into the user's own modules of the same layout, and back.
    parts = _user_parts(30, [20, 10], 4, [10, 20], "gelu", head == "joint", False, torch.float32, "cpu")
    holder = nn.Module()
    holder.encoder, holder.fc_mu, holder.decoder = parts[0], parts[1], parts[3]
    if parts[2] is not None:
        holder.fc_logvar = parts[2]
    holder.load_state_dict(fused.state_dict(), strict=True)
    x, eps = torch.rand(8, 30), torch.randn(8, 4)
    for g, w in zip(fused(x, eps), _user_loss(parts, x, eps, "gaussian")):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    again = VAE(30, [20, 10], 4, activation="gelu", head=head, likelihood="gaussian")
    again.load_state_dict(holder.state_dict(), strict=True)
    for g, w in zip(again(x, eps), fused(x, eps)):
        assert torch.equal(g, w)


def test_default_layout_stays_on_vae_elbo():
    torch.manual_seed(2)
    fused = VAE(20, [8], 3)
    ref = fused_ops.reference.VAE(20, 8, 3)
    assert fused._mlp is None and list(fused.state_dict()) == list(ref.state_dict())
    parts = _user_parts(20, [8], 3, [8], "relu", False, True, torch.float32, "cpu")
    assert VAE.from_modules(*parts)._mlp is None


def test_image_batches_and_outputs():
    fused = VAE(784, [64, 32], 8, activation="silu", head="joint")
    x = torch.rand(5, 1, 28, 28)
    eps = torch.randn(5, 8)
    elbo, recon, kl, recon_x, mu, logvar = fused.forward_with_outputs(x, eps)
    assert elbo.shape == (5,) and recon_x.shape == x.shape and mu.shape == logvar.shape == (5, 8)
    torch.testing.assert_close(elbo, fused(x.view(5, -1), eps)[0])
    assert ((recon_x >= 0) & (recon_x <= 1)).all()


def _small():
    return _op_inputs(6, [5, 4], 2, [4, 5], 3, dtype=torch.float32)


BAD_LISTS = [
    ("no_encoder_layer", lambda a: {**a, "ew": [], "eb": []}, r"enc_weights must hold 1 to 4 Linear weights.*got 0"),
    ("five_encoder_layers", lambda a: {**a, "ew": a["ew"][:1] * 5, "eb": a["eb"][:1] * 5},
     r"enc_weights must hold 1 to 4 Linear weights.*got 5"),
    ("bias_count", lambda a: {**a, "eb": a["eb"][:1]}, r"enc_biases must hold one bias per encoder layer \(2\), got 1"),
    ("decoder_output_only", lambda a: {**a, "dw": a["dw"][-1:], "db": a["db"][-1:]},
     r"dec_weights must hold 2 to 5 Linear weights.*got 1"),
    ("width_mismatch_enc1", lambda a: {**a, "ew": [a["ew"][0], torch.randn(4, 3)]},
     r"enc_weights\[1\]\.shape\[1\] must be 5 \(the output width of the layer before\)"),
    ("width_mismatch_dec1", lambda a: {**a, "dw": [a["dw"][0], torch.randn(5, 7), a["dw"][2]]},
     r"dec_weights\[1\]\.shape\[1\] must be 4"),
    ("logvar_needs_gaussian", lambda a: {**a, "lv": torch.zeros(6), "lik": 0}, r"dec_logvar .* needs likelihood 3"),
    ("logvar_size", lambda a: {**a, "lv": torch.zeros(5), "lik": 3}, r"dec_logvar\.shape\[0\] must be 6"),
    ("activation_code", lambda a: {**a, "act": -1}, r"activation must be 0 \.\. 9"),
]


@pytest.mark.parametrize("change,message", [pytest.param(c, m, id=i) for i, c, m in BAD_LISTS])
@pytest.mark.parametrize("on", ["cpu", "meta"])
def test_bad_lists(change, message, on):
    x, eps, ew, eb, wh, bh, dw, db, _ = _small()
    a = change(dict(x=x, eps=eps, ew=ew, eb=eb, wh=wh, bh=bh, dw=dw, db=db, lv=None, act=1, lik=3))
    args = [a["x"], a["eps"], a["ew"], a["eb"], a["wh"], a["bh"], a["dw"], a["db"], a["lv"], a["act"], 0.0, a["lik"]]
    if on == "meta":
        args = [[t.to("meta") for t in v] if isinstance(v, list) else v.to("meta") if isinstance(v, torch.Tensor)
                else v for v in args]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fused_ops.vae_mlp_elbo(*args)


def test_bad_names():
    x, eps, ew, eb, wh, bh, dw, db, _ = _small()
    with pytest.raises(ValueError, match="activation must be one of"):
        fused_ops.vae_mlp_elbo(x, eps, ew, eb, wh, bh, dw, db, activation="mish")
    with pytest.raises(ValueError, match="likelihood must be one of"):
        fused_ops.vae_mlp_elbo(x, eps, ew, eb, wh, bh, dw, db, likelihood="poisson")
    with pytest.raises(ValueError, match="hidden_dim must hold 1 to 4 widths"):
        VAE(10, [8, 8, 8, 8, 8], 2, activation="silu")
    with pytest.raises(ValueError, match="head must be"):
        VAE(10, [8], 2, head="three")
    assert _vae_mlp.MAX_HIDDEN == 4


def test_readme_example_runs():
    """The README's deeper-MLP VAE block runs as written (CPU)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text[text.index("#### Deeper MLPs and other activations"):]
    start = block.index("```python\n") + len("```python\n")
    scope = {}
    exec(block[start:block.index("```\n", start)], scope)  # noqa: S102
    assert scope["elbo"].shape == (32,) and scope["vae"]._mlp is not None
    assert scope["head"].weight.grad is not None and scope["encoder"][0].weight.grad is not None
