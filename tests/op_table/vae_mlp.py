"""op_cases entry of vae_mlp_elbo: sizes (B, I, H1, H2, L, activation, likelihood).

The op's schema takes its layers as lists; the table's flat tensors are a
two-hidden-layer VAE named as the op's errors name them: ``x, eps,
enc_weights[0..1]`` (``[H1, I], [H2, H1]``), ``enc_biases[0..1], w_head``
(``[2L, H2]``: mu rows, then logvar rows), ``b_head, dec_weights[0..2]``
(``[H2, L], [H1, H2], [I, H1]``), ``dec_biases[0..2]``;
``VaeMlpCase.op_args`` regroups them, with ``dec_logvar=None`` (optional: a
None there is valid).  Scalars ``(activation, act_param, likelihood)``.
Depths 1, 3 and 4, the split head, the learned log-variance and the module
are tests/test_vae_mlp.py's, which the flat two-layer rows cannot express.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fused_ops
from fused_ops.ops import _ode
from fused_test_utils import arg_modifier
from op_table.base import (
    F32, F32_ULP, F64, Accuracy, Bad, BwdBad, OpCase, PathCase, every, max_abs, set_arg, strided, transposed,
)

ARG_NAMES = ("x", "eps", "enc_weights[0]", "enc_weights[1]", "enc_biases[0]", "enc_biases[1]", "w_head", "b_head",
             "dec_weights[0]", "dec_weights[1]", "dec_weights[2]", "dec_biases[0]", "dec_biases[1]",
             "dec_biases[2]")
_PARAM = {2: 0.1, 3: 0.8}  # leaky_relu slope, elu alpha
_LIK = ("bernoulli", "bernoulli_logits", "gaussian_sigmoid", "gaussian")


def group(args):
    """The op's tensor arguments (lists regrouped) from the table's flat ones."""
    x, eps, e0, e1, c0, c1, wh, bh, d0, d1, d2, g0, g1, g2 = args
    return (x, eps, [e0, e1], [c0, c1], wh, bh, [d0, d1, d2], [g0, g1, g2], None)


@dataclass(frozen=True)
class VaeMlpCase(OpCase):
    def op_args(self, args, size, scalars=None):
        return (*group(args), *(self.scalars(size) if scalars is None else scalars))

    def bwd_op_args(self, a):
        """``a`` = (grad_elbo, grad_recon, grad_kl, the 14 flat tensors, scalars...)."""
        return (*a[:3], *group(a[3:17]), *a[17:])


def _scalars(s):
    return (s[5], _PARAM.get(s[5], 0.0), s[6])


def _fn(x, eps, ew, eb, wh, bh, dw, db, dec_logvar, act, p, lik):
    return fused_ops.vae_mlp_elbo(x, eps, ew, eb, wh, bh, dw, db, activation=act, act_param=p, likelihood=lik,
                                  dec_logvar=dec_logvar)


def reference(x, eps, ew, eb, wh, bh, dw, db, dec_logvar, act, p, lik):
    """The plain PyTorch program the op replaces (csrc/vae_mlp.h)."""
    f = _ode._TORCH_ACTS[list(_ode.ACTIVATIONS)[act]]
    h = x
    for w, b in zip(ew, eb):
        h = f(F.linear(h, w, b), p)
    ml = F.linear(h, wh, bh)
    n = eps.shape[1]
    mu, logvar = ml[:, :n], ml[:, n:]
    g = mu + torch.exp(0.5 * logvar) * eps
    for w, b in zip(dw[:-1], db[:-1]):
        g = f(F.linear(g, w, b), p)
    a = F.linear(g, dw[-1], db[-1])
    if dec_logvar is not None:
        recon = -torch.distributions.Normal(a, torch.exp(0.5 * dec_logvar)).log_prob(x).sum(-1)
    elif lik == 0:
        recon = F.binary_cross_entropy(torch.sigmoid(a), x, reduction="none").sum(-1)
    elif lik == 1:
        recon = F.binary_cross_entropy_with_logits(a, x, reduction="none").sum(-1)
    elif lik == 2:
        recon = F.mse_loss(torch.sigmoid(a), x, reduction="none").sum(-1)
    else:
        recon = F.mse_loss(a, x, reduction="none").sum(-1)
    kl = -0.5 * (1 + logvar - mu**2 - torch.exp(logvar)).sum(-1)
    return -(recon + kl), recon, kl


def _make(s, dtype=F32, device="cpu", requires_grad=False, scale=1.0):
    B, I, H1, H2, L = s[:5]

    def lin(n_out, n_in):
        k = scale / n_in**0.5
        return [torch.randn(n_out, n_in, dtype=dtype) * k, torch.randn(n_out, dtype=dtype) * 0.1]

    x, eps = torch.rand(B, I, dtype=dtype), torch.randn(B, L, dtype=dtype)
    (e0, c0), (e1, c1), (wh, bh) = lin(H1, I), lin(H2, H1), lin(2 * L, H2)
    wh[L:] *= 0.5  # logvar rows: exp(logvar) of moderate size
    (d0, g0), (d1, g1), (d2, g2) = lin(H2, L), lin(H1, H2), lin(I, H1)
    args = [t.to(device) for t in (x, eps, e0, e1, c0, c1, wh, bh, d0, d1, d2, g0, g1, g2)]
    return [a.requires_grad_(requires_grad) for a in args]


def _bad(**changes):
    return arg_modifier(ARG_NAMES, **changes)


def _module(device):
    torch.manual_seed(0)
    module = fused_ops.nn.VAE(40, [24, 12], 4, activation="silu", likelihood="gaussian").to(device)
    ref = _PlainVAE(module)
    return module, ref, (torch.rand(16, 40, device=device), torch.randn(16, 4, device=device))


class _PlainVAE(torch.nn.Module):
    """The users' program for a module of the general layout: its own layers, the loss written out."""

    def __init__(self, fused):
        super().__init__()
        self.fused = fused

    def forward(self, x, eps):
        m = self.fused
        h = m.encoder(x)
        mu, logvar = m.fc_mu(h).chunk(2, -1) if m.fc_logvar is None else (m.fc_mu(h), m.fc_logvar(h))
        out = m.decoder(mu + torch.exp(0.5 * logvar) * eps)
        recon = F.mse_loss(out, x, reduction="none").sum(-1)
        kl = -0.5 * (1 + logvar - mu**2 - torch.exp(logvar)).sum(-1)
        return -(recon + kl), recon, kl


def _bwd_args(case, size, dtype, device, grads=(True, True, True)):
    args = case.inputs(size, dtype=dtype, device=device)
    ups = tuple(torch.randn(size[0], dtype=dtype, device=device) if g else None for g in grads)
    return (*ups, *args, *case.scalars(size))


def _grad32_check(case, got, ref32, exact, ctx):
    for name, g, w, e in zip(case.arg_names, got, ref32, exact):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * max(max_abs(w), 1.0),
                                   msg=lambda m, n=name: f"grad {n}: {m}")
        # Root-sum-square errors against float64 (bias gradients are batch
        # sums): within twice the eager program's, or 32 float32 ulps of the
        # gradient's norm (the rounding of a chain of float32 products, summed
        # in another order than eager's, reaches ~10 ulps at some draws while
        # the eager error happens to be small).
        fused_err = (g.double() - e).norm().item()
        eager_err = (w.double() - e).norm().item()
        floor = 32 * F32_ULP * e.norm().item()
        assert fused_err <= max(2 * eager_err, floor), (name, fused_err, eager_err, floor)


def _gradcheck_inputs(case, size, device):
    # Smooth activations and likelihoods only (the table's gradcheck sizes); no
    # target within the step of 0 or 1 (the Bernoulli term needs x in [0, 1]).
    args = case.inputs(size, dtype=F64, device=device)
    args[0] = args[0].clamp(0.01, 0.99)
    return [a.requires_grad_() for a in args]


# (B, I, H1, H2, L, activation, likelihood): every activation the issue names
# and every likelihood, odd widths, several CPU row blocks and a partial one.
SIZES = (
    (5, 9, 7, 5, 3, 1, 0), (70, 13, 11, 6, 3, 0, 3), (3, 6, 5, 4, 2, 2, 1), (130, 20, 17, 9, 4, 3, 2),
    (17, 10, 8, 8, 5, 5, 3), (33, 7, 9, 3, 1, 6, 0), (64, 16, 16, 8, 2, 8, 1), (1, 4, 3, 2, 1, 1, 2),
    (128, 784, 512, 256, 64, 1, 3),
)

VAE_MLP = VaeMlpCase(
    name="vae_mlp_elbo",
    fn=_fn,
    packet=torch.ops.fused_ops.vae_mlp_elbo,
    reference=reference,
    make=_make,
    arg_names=ARG_NAMES,
    out_names=("elbo", "recon", "kl"),
    out_shapes=lambda s: [(s[0],)] * 3,
    scalars=_scalars,
    func_transforms=False,
    tensor_dims=(0, 1, 2, 3, 4),
    fresh_first=torch.rand_like,
    size_id=lambda s: "B{}-I{}-H{}x{}-L{}-{}-{}".format(*s[:5], list(_ode.ACTIVATIONS)[s[5]], _LIK[s[6]]),
    match_sizes=SIZES,
    float64_tight=(((70, 13, 11, 6, 3, 0, 3), 1e-12),),
    accuracy=tuple(Accuracy(s, trials=2, floor_ulps=4) for s in ((128, 784, 512, 256, 64, 1, 3),
                                                                 (130, 20, 17, 9, 4, 3, 2))),
    poison_sizes=((5, 9, 7, 5, 3, 1, 0), (130, 20, 17, 9, 4, 3, 2)),
    poison_numels=lambda s: (s[0],),
    layouts={"transposed": (every(transposed), "noncontig"), "strided": (every(strided), "noncontig")},
    layout_sizes=((70, 13, 11, 6, 3, 0, 3),),
    empty_size=(0, 5, 4, 3, 2, 1, 3),
    opcheck_sizes=((1, 3, 2, 2, 1, 1, 0), (6, 5, 7, 4, 3, 0, 3)),
    meta_size=(11, 5, 7, 4, 3, 5, 1),
    module=_module,
    compile_size=(20, 9, 8, 5, 3, 0, 3),
    compile_loss=lambda o: o[0].sum() + 0.5 * o[1].mean() + o[2].sum(),
    compile_tol=dict(rtol=1e-4, atol=1e-4),
    determinism_sizes=((130, 20, 17, 9, 4, 3, 2), (300, 40, 32, 16, 8, 1, 0)),
    thread_size=(300, 40, 32, 16, 8, 1, 0),
    bad_size=(6, 5, 7, 4, 3, 1, 0),
    bad_inputs=(
        Bad("x_1d", _bad(x=lambda t: t[0]), "x", r"2-D"),
        Bad("eps_rows", _bad(eps=lambda t: t[:5]), "eps", r"eps\.shape\[0\] must be 6"),
        Bad("enc1_width_mismatch", _bad(**{"enc_weights[1]": lambda t: t[:, :6]}), "enc_weights[1]",
            r"enc_weights\[1\]\.shape\[1\] must be 7 \(the output width of the layer before\)"),
        Bad("enc0_input", _bad(**{"enc_weights[0]": lambda t: t[:, :4]}), "enc_weights[0]",
            r"enc_weights\[0\]\.shape\[1\] must be 5 \(I"),
        Bad("enc_bias", _bad(**{"enc_biases[0]": lambda t: t[:6]}), "enc_biases[0]",
            r"enc_biases\[0\]\.shape\[0\] must be 7"),
        Bad("head_rows", _bad(w_head=lambda t: t[:5]), "w_head", r"w_head\.shape\[0\] must be 6 \(2L"),
        Bad("head_cols", _bad(w_head=lambda t: t[:, :3]), "w_head", r"w_head\.shape\[1\] must be 4"),
        Bad("b_head", _bad(b_head=lambda t: t[:3]), "b_head", r"b_head\.shape\[0\] must be 6"),
        Bad("dec0_latent", _bad(**{"dec_weights[0]": lambda t: t[:, :2]}), "dec_weights[0]",
            r"dec_weights\[0\]\.shape\[1\] must be 3 \(L"),
        Bad("dec1_width_mismatch", _bad(**{"dec_weights[1]": lambda t: t[:, :3]}), "dec_weights[1]",
            r"dec_weights\[1\]\.shape\[1\] must be 4"),
        Bad("dec_out_rows", _bad(**{"dec_weights[2]": lambda t: t[:4], "dec_biases[2]": lambda t: t[:4]}),
            "dec_weights[2]", r"dec_weights\[2\]\.shape\[0\] must be 5 \(I: the last decoder layer"),
        Bad("enc_bias1", _bad(**{"enc_biases[1]": lambda t: t[:3]}), "enc_biases[1]",
            r"enc_biases\[1\]\.shape\[0\] must be 4"),
        Bad("dec_bias0", _bad(**{"dec_biases[0]": lambda t: t[:3]}), "dec_biases[0]",
            r"dec_biases\[0\]\.shape\[0\] must be 4"),
        Bad("dec_bias2_None", _bad(**{"dec_biases[2]": lambda t: None}), "dec_biases[2]",
            r"dec_biases\[2\] must be a 1-D tensor \[out\], got None"),
        Bad("dec_bias_2d", _bad(**{"dec_biases[1]": lambda t: t[None]}), "dec_biases[1]", r"1-D"),
        Bad("x_int64", _bad(x=lambda t: t.long()), "x", r"float"),
        Bad("dec2_float64", _bad(**{"dec_weights[2]": lambda t: t.double()}), "dec_weights[2]",
            r"dec_weights\[2\] must have the same dtype as x"),
        Bad("activation", _bad(), "activation", r"activation must be 0 \.\. 9", scalars=(10, 0.0, 0)),
        Bad("likelihood", _bad(), "likelihood", r"likelihood must be 0", scalars=(1, 0.0, 4)),
        Bad("x_not_probability", _bad(x=lambda t: t * 3 - 1), "x", r"\[0, 1\].*x\[\d+, \d+\] = ", cpu_only=True),
    ),
    stream_sizes=((130, 20, 17, 9, 4, 3, 2),),
    graph_sizes=((130, 20, 17, 9, 4, 3, 2),),
    cuda_cpu_float64=(((130, 20, 17, 9, 4, 3, 2), 1e-12, 1e-12), ((128, 784, 512, 256, 64, 1, 3), 1e-10, 1e-10)),
    isa_sizes=((70, 13, 11, 6, 3, 0, 3),),
    gradcheck_sizes=(((3, 5, 4, 3, 2, 0, 1), False), ((70, 4, 3, 5, 2, 5, 3), True)),
    gradcheck_inputs=_gradcheck_inputs,
    gradcheck_tol=dict(eps=1e-6, atol=1e-6, rtol=1e-5),
    gradcheck_alone_size=(3, 5, 4, 3, 2, 8, 2),
    grad64_sizes=tuple((s, ((0, 1, 2),), {}) for s in ((70, 13, 11, 6, 3, 0, 3), (33, 7, 9, 3, 1, 6, 0),
                                                       (130, 20, 17, 9, 4, 3, 2))),
    grad64_tol=(1e-10, 1e-12),
    grad32_sizes=tuple((s, sub) for s in ((130, 20, 17, 9, 4, 3, 2), (64, 16, 16, 8, 2, 8, 1))
                       for sub in ((0, 1, 2), (1,))),
    grad32_check=_grad32_check,
    bwd=torch.ops.fused_ops.vae_mlp_elbo_backward.default,
    bwd_args=_bwd_args,
    bwd_grad_names=("grad_elbo", "grad_recon", "grad_kl"),
    bwd_upstream_index=0,
    bwd_opcheck_sizes=((6, 5, 7, 4, 3, 0, 3),),
    bwd_opcheck_grads=((True, True, True), (False, True, False), (True, False, False)),
    bwd_meta_size=(11, 5, 7, 4, 3, 5, 1),
    bwd_determinism_sizes=((130, 20, 17, 9, 4, 3, 2),),
    bwd_bad_size=(4, 6, 5, 4, 3, 1, 0),
    bwd_bad=(
        BwdBad("grad_recon-size", set_arg(1, lambda a: torch.ones(5, device=a[3].device)),
               r"grad_recon\.shape\[0\] must be 4"),
        BwdBad("grad_kl-dtype", set_arg(2, lambda a: torch.ones(4, dtype=F64, device=a[3].device)),
               "grad_kl must have the same dtype"),
        BwdBad("x-None", set_arg(3, lambda a: None), r"x must be a 2-D tensor \[B, I\], got None$"),
        BwdBad("dec_weights[1]-width", set_arg(12, lambda a: a[12][:, :2]),
               r"dec_weights\[1\]\.shape\[1\] must be 4"),
        BwdBad("grad_elbo-device", set_arg(0, lambda a: a[0].cpu()), "grad_elbo must be on the same device as x",
               cuda_only=True),
    ),
    bwd_empty_size=(0, 6, 5, 4, 3, 1, 0),
    bwd_linearity_size=(9, 6, 5, 4, 3, 0, 3),
    bwd_stream_size=(130, 20, 17, 9, 4, 3, 2),
    bwd_graph_size=(130, 20, 17, 9, 4, 3, 2),
    bwd_cuda_cpu_sizes=((130, 20, 17, 9, 4, 3, 2), (128, 784, 512, 256, 64, 1, 3)),
    paths=(PathCase("cluster", (130, 20, 17, 9, 4, 3, 2)), PathCase("cluster", (128, 784, 512, 256, 64, 1, 3)),
           PathCase("cluster", (600, 13, 11, 6, 3, 0, 0), note="forced past the natural batch limit"),
           PathCase("cublas", (130, 20, 17, 9, 4, 3, 2)), PathCase("cublas", (70, 13, 11, 6, 3, 0, 3), F64)),
    natural=(PathCase("cluster", (128, 784, 512, 256, 64, 1, 3)), PathCase("cluster", (1, 4, 3, 2, 1, 1, 2)),
             PathCase("cublas", (600, 20, 17, 9, 4, 3, 2), note="B above the cluster path's 512"),
             PathCase("cublas", (70, 13, 11, 6, 3, 0, 3), F64)),
    refused=(PathCase("cluster", (70, 13, 11, 6, 3, 0, 3), F64, note="float32 only"),),
    path_names=("cluster", "cublas"),
    sm90_paths=frozenset({"cluster"}),
    bwd_path_names=("cublas",),
    bwd_paths=(PathCase("cublas", (130, 20, 17, 9, 4, 3, 2), F64),),
    bwd_natural=(PathCase("cublas", (8192, 784, 512, 256, 64, 1, 3)),),
)
