"""vae_mlp_elbo's ``cluster`` CUDA path (csrc/cuda/vae_mlp/cluster.cu): the
forward of small float32 batches in one launch of thread-block clusters on
sm_90.

Forced (``_paths.force("vae_mlp_elbo", "cluster")``) over every likelihood
(with and without a learned dec_logvar), every activation, depths 1-4, odd
widths (33, 17, 300), odd I (101) and B in {1, 5, 16, 17, 128, 300}, against
the CPU kernel in float64 on the same float32 inputs, within a small
multiple of the CPU float32 run's own error.  Outputs come from
NaN-poisoned memory, so an unwritten element fails.  Two calls agree
bitwise; the table takes the path for small float32 batches only.

All of it needs a CUDA GPU of compute capability 9.0; elsewhere it is skipped.
"""

import math

import pytest
import torch

import fused_ops
from fused_ops.ops import _ode
from fused_test_utils import CUDA_AVAILABLE, poison_allocator

F32, F64 = torch.float32, torch.float64
ACTS = list(_ode.ACTIVATIONS)
PARAMS = {"leaky_relu": 0.2, "elu": 0.7, "softplus": 2.0}
LIKS = ("bernoulli", "bernoulli_logits", "gaussian_sigmoid", "gaussian")

pytestmark = pytest.mark.skipif(
    not CUDA_AVAILABLE or torch.cuda.get_device_capability() < (9, 0),
    reason="the cluster path needs a CUDA GPU of compute capability 9.0")

if CUDA_AVAILABLE:
    from fused_ops import _paths


def _program(B, I, enc, L, dec, lik, logvar=False):
    """Float32 CPU inputs: nn.Linear-scaled weights, x in [0, 1] (valid for every likelihood)."""
    def lin(o, i):
        return torch.randn(o, i, dtype=F64) / math.sqrt(i), torch.randn(o, dtype=F64) * 0.1
    ew, eb, dw, db = [], [], [], []
    k = I
    for n in enc:
        w, b = lin(n, k)
        ew.append(w), eb.append(b)
        k = n
    wh, bh = lin(2 * L, k)
    k = L
    for n in (*dec, I):
        w, b = lin(n, k)
        dw.append(w), db.append(b)
        k = n
    x = torch.rand(B, I, dtype=F64)
    eps = torch.randn(B, L, dtype=F64)
    s = torch.randn(I, dtype=F64) * 0.3 if logvar else None
    f = lambda v: None if v is None else v.float()  # noqa: E731
    return dict(x=f(x), eps=f(eps), ew=[f(w) for w in ew], eb=[f(b) for b in eb], wh=f(wh), bh=f(bh),
                dw=[f(w) for w in dw], db=[f(b) for b in db], s=f(s), lik=lik)


def _call(p, act="silu", device=None, dtype=None):
    c = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return fused_ops.vae_mlp_elbo(c(p["x"]), c(p["eps"]), [c(w) for w in p["ew"]], [c(b) for b in p["eb"]],
                                  c(p["wh"]), c(p["bh"]), [c(w) for w in p["dw"]], [c(b) for b in p["db"]],
                                  activation=act, act_param=PARAMS.get(act, 0.0), likelihood=p["lik"],
                                  dec_logvar=c(p["s"]))


def _run_cluster(p, act):
    B = p["x"].shape[0]
    poison_allocator("cuda", F32, [B, B, B])
    with _paths.force("vae_mlp_elbo", "cluster"):
        got = _call(p, act, device="cuda")
        torch.cuda.synchronize()
        assert _paths.last("vae_mlp_elbo") == "cluster"
        again = _call(p, act, device="cuda")
    for g, a in zip(got, again):
        assert torch.equal(g, a), "two calls differ bitwise"
    return [g.cpu() for g in got]


def _check(p, act="silu", factor=4.0):
    got = _run_cluster(p, act)
    exact = _call(p, act, dtype=F64)
    ref32 = _call(p, act)
    for name, g, e, r in zip(("elbo", "recon", "kl"), got, exact, ref32):
        assert torch.isfinite(g).all(), f"{name}: non-finite (unwritten?) elements"
        err = (g.double() - e).abs().max().item()
        err32 = (r.double() - e).abs().max().item()
        scale = max(e.abs().max().item(), 1.0)
        allowed = factor * err32 + 64 * 2.0**-23 * scale
        assert err <= allowed, f"{name}: cluster error {err:.3e} vs CPU float32's {err32:.3e} (allowed {allowed:.3e})"


# (B, I, encoder widths, L, decoder hidden widths): every B meets odd and
# float4-able shapes; depths 1 to 4 on both sides.
_SHAPES = [
    (1, 101, (33,), 5, (17,)),
    (5, 20, (17, 9), 4, (9, 17)),
    (16, 784, (512, 256), 64, (256, 512)),
    (17, 101, (300, 33, 17), 3, (17, 33, 300)),
    (128, 784, (512, 256), 64, (256, 512)),
    (128, 64, (33, 17, 300, 5), 7, (5, 300, 17, 33)),
    (300, 32, (64,), 8, (64, 32)),
    (17, 1, (1,), 1, (1,)),
]


@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "B{}-I{}-e{}-L{}-d{}".format(
    s[0], s[1], "x".join(map(str, s[2])), s[3], "x".join(map(str, s[4]))))
@pytest.mark.parametrize("lik", LIKS)
def test_cluster_shapes_likelihoods(shape, lik):
    _check(_program(*shape, lik=lik))


@pytest.mark.parametrize("shape", [(5, 101, (33,), 5, (17,)), (128, 784, (512, 256), 64, (256, 512))])
def test_cluster_learned_logvar(shape):
    _check(_program(*shape, lik="gaussian", logvar=True))


@pytest.mark.parametrize("act", ACTS)
def test_cluster_activations(act):
    _check(_program(17, 101, (33, 17), 5, (17, 33), lik="bernoulli_logits"), act=act)


@pytest.mark.parametrize("B,dtype,expected", [(1, F32, True), (128, F32, True), (512, F32, True),
                                              (513, F32, False), (16, F64, False)])
def test_cluster_natural_choice(B, dtype, expected):
    p = _program(B, 20, (17,), 4, (9,), lik="gaussian")
    _call(p, device="cuda", dtype=dtype)
    assert (_paths.last("vae_mlp_elbo") == "cluster") == expected


def test_cluster_forced_above_natural_limit():
    _check(_program(600, 20, (17, 9), 4, (9, 17), lik="bernoulli"))
