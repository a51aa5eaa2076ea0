"""ode_mlp / odeint_mlp / nn.ODESampler against torchdiffeq: every method,
time position, activation, depth, embedding and conditioning, float32 and
float64, increasing and decreasing grids, step_size grids with interpolated
outputs, gradients against torchdiffeq's autograd, the sampler module; and
what the op table (tests/op_table/ode_mlp.py, run by the contract tests)
cannot express: list lengths, sample_bias, all_states=False, other depths on
the CUDA paths."""

import math

import pytest
import torch
from torch import nn

import fused_ops
from fused_ops import _paths
from fused_ops.ops import _ode
from fused_test_utils import requires_cuda

torchdiffeq = pytest.importorskip("torchdiffeq")

F32, F64 = torch.float32, torch.float64
METHODS = list(_ode.METHODS)
ACTS = list(_ode.ACTIVATIONS)
PARAMS = {"leaky_relu": 0.2, "elu": 0.7, "softplus": 2.0}


def make_mlp(d, widths, in_extra=0, dtype=F64, device="cpu", requires_grad=False, scale=1.0):
    """nn.Linear-style weights and biases for d + in_extra inputs -> widths -> d."""
    dims = [d + in_extra] + list(widths) + [d]
    ws, bs = [], []
    for i, o in zip(dims[:-1], dims[1:]):
        w = torch.randn(o, i, dtype=dtype, device=device) * (scale / math.sqrt(i))
        b = torch.randn(o, dtype=dtype, device=device) * 0.1
        ws.append(w.requires_grad_(requires_grad))
        bs.append(b.requires_grad_(requires_grad))
    return ws, bs


def sinusoidal(dim=4):
    freqs = torch.arange(1, dim // 2 + 1, dtype=F64)

    def emb(t):
        a = t[:, None] * freqs.to(t)
        return torch.cat([torch.sin(a), torch.cos(a)], dim=-1)

    return emb, dim


def reference(x0, t, ws, bs, method, step_size=None, **spec):
    func = _ode.mlp_velocity(ws, bs, **spec)
    options = None if step_size is None else dict(step_size=step_size)
    return torchdiffeq.odeint(func, x0, t, method=method, options=options)


def tol(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == F64 else dict(rtol=2e-4, atol=2e-5)


# ---------------------------------------------------------------------------
# The semantics: odeint_fixed is torchdiffeq, bitwise
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("grid", ["up", "down"])
@pytest.mark.parametrize("step_size", [None, 0.13, 0.25])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
def test_odeint_fixed_is_torchdiffeq_bitwise(method, grid, step_size, dtype):
    x0 = torch.randn(6, 3, dtype=dtype)
    ws, bs = make_mlp(3, [16, 16], 1, dtype)
    func = _ode.mlp_velocity(ws, bs, "tanh")
    t = torch.tensor([0.0, 0.1, 0.35, 0.5, 1.0], dtype=dtype)
    if grid == "down":
        t = t.flip(0)
    want = torchdiffeq.odeint(func, x0, t, method=method, options=None if step_size is None else dict(step_size=step_size))
    got = _ode.odeint_fixed(func, x0, t, method, step_size)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------
# The fused op against torchdiffeq
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("method", METHODS)
def test_methods_and_activations(method, act, dtype, device):
    time = ("last", "first", "none")[(METHODS.index(method) + ACTS.index(act)) % 3]
    x0 = torch.randn(37, 3, dtype=dtype, device=device)
    ws, bs = make_mlp(3, [20, 13], 0 if time == "none" else 1, dtype, device)
    t = torch.linspace(0, 1, 7, dtype=dtype, device=device)
    spec = dict(activation=act, activation_param=PARAMS.get(act), time=time)
    want = reference(x0, t, ws, bs, method, **spec)
    got = fused_ops.odeint_mlp(x0, t, ws, bs, method=method, **spec)
    torch.testing.assert_close(got, want, **tol(dtype))
    last = fused_ops.odeint_mlp(x0, t, ws, bs, method=method, return_all=False, **spec)
    torch.testing.assert_close(last, want[-1], **tol(dtype))


@pytest.mark.parametrize("depth", range(1, 9))
def test_depths_and_widths(depth, device):
    widths = [int(w) for w in torch.randint(1, 40, (depth - 1,))]
    x0 = torch.randn(70, 5, dtype=F64, device=device)
    ws, bs = make_mlp(5, widths, 1, device=device)
    t = torch.linspace(0, 1, 5, dtype=F64, device=device)
    got = fused_ops.odeint_mlp(x0, t, ws, bs, method="midpoint", activation="gelu")
    torch.testing.assert_close(got, reference(x0, t, ws, bs, "midpoint", activation="gelu"), **tol(F64))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("direction", ["up", "down"])
@pytest.mark.parametrize("step_size", [0.05, 0.13, 0.3])
def test_step_size_grids_interpolate(method, direction, step_size, device):
    x0 = torch.randn(9, 2, dtype=F64, device=device)
    ws, bs = make_mlp(2, [32, 32, 32], 1, device=device)
    t = torch.tensor([0.0, 0.02, 0.3, 0.31, 0.77, 1.0], dtype=F64, device=device)
    if direction == "down":
        t = t.flip(0)
    got = fused_ops.odeint_mlp(x0, t, ws, bs, method=method, step_size=step_size)
    torch.testing.assert_close(got, reference(x0, t, ws, bs, method, step_size), **tol(F64))


@pytest.mark.parametrize("time", ["first", "last"])
@pytest.mark.parametrize("embedding", ["sinusoidal", "learned"])
@pytest.mark.parametrize("with_cond", [False, True])
def test_embedding_and_conditioning_with_gradients(time, embedding, with_cond, device):
    """Values and gradients (x0, every weight and bias, the embedding's
    parameters, cond) against torchdiffeq's autograd, float64."""
    B, D, C = 11, 3, 2
    if embedding == "sinusoidal":
        emb, F = sinusoidal(6)
        emb_params = []
    else:
        F = 5
        emb = nn.Sequential(nn.Linear(1, 8), nn.SiLU(), nn.Linear(8, F)).double().to(device)
        net = emb
        emb = lambda t, net=net: net(t[:, None])  # noqa: E731
        emb_params = list(net.parameters())
    x0 = torch.randn(B, D, dtype=F64, device=device, requires_grad=True)
    cond = torch.randn(B, C, dtype=F64, device=device, requires_grad=True) if with_cond else None
    ws, bs = make_mlp(D, [24, 24], F + (C if with_cond else 0), device=device, requires_grad=True)
    t = torch.linspace(1, 0, 4, dtype=F64, device=device)
    spec = dict(activation="softplus", time=time, time_embedding=emb, cond=cond)
    params = [x0, *ws, *bs, *emb_params] + ([cond] if with_cond else [])
    want = reference(x0, t, ws, bs, "rk4", 0.2, **spec)
    got = fused_ops.odeint_mlp(x0, t, ws, bs, method="rk4", step_size=0.2, **spec)
    torch.testing.assert_close(got, want, **tol(F64))
    up = torch.randn_like(want)
    gw = torch.autograd.grad((want * up).sum(), params)
    gg = torch.autograd.grad((got * up).sum(), params)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("act", ["silu", "elu", "gelu_tanh", "leaky_relu", "sigmoid"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
def test_gradients_match_torchdiffeq(method, act, dtype, device):
    x0 = torch.randn(13, 2, dtype=dtype, device=device, requires_grad=True)
    ws, bs = make_mlp(2, [16, 16, 16], 1, dtype, device, requires_grad=True)
    t = torch.linspace(0, 1, 6, dtype=dtype, device=device)
    params = [x0, *ws, *bs]
    spec = dict(activation=act, activation_param=PARAMS.get(act))
    want = reference(x0, t, ws, bs, method, **spec)
    got = fused_ops.odeint_mlp(x0, t, ws, bs, method=method, **spec)
    loss_w = want.square().sum() + want[-1].sum()
    loss_g = got.square().sum() + got[-1].sum()
    for a, b in zip(torch.autograd.grad(loss_g, params), torch.autograd.grad(loss_w, params)):
        torch.testing.assert_close(a, b, **(tol(dtype) if dtype == F64 else dict(rtol=1e-3, atol=1e-4)))


def test_last_only_gradient(device):
    """return_all=False under grad: the states are kept for the backward; the
    gradient reaches only the last one."""
    x0 = torch.randn(5, 2, dtype=F64, device=device, requires_grad=True)
    ws, bs = make_mlp(2, [8], 1, device=device, requires_grad=True)
    t = torch.linspace(0, 1, 4, dtype=F64, device=device)
    got = fused_ops.odeint_mlp(x0, t, ws, bs, method="heun3", return_all=False)
    want = reference(x0, t, ws, bs, "heun3")[-1]
    g1 = torch.autograd.grad(got.sum(), [x0, *ws])
    g2 = torch.autograd.grad(want.sum(), [x0, *ws])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, **tol(F64))


def test_op_gradcheck(device):
    """gradcheck of the op with a sample_bias and with all_states=False (the
    op table's rows: no sample_bias, all_states=True)."""
    x0 = torch.randn(3, 2, dtype=F64, device=device, requires_grad=True)
    ws, bs = make_mlp(2, [5, 4], 0, device=device, requires_grad=True)
    tg = torch.tensor([0.0, 0.3, 0.5], dtype=F64, device=device)
    tb = torch.randn(2 * 2, 5, dtype=F64, device=device, requires_grad=True)
    sb = torch.randn(3, 5, dtype=F64, device=device, requires_grad=True)
    for all_states in (True, False):
        def f(x0, tb, sb, *wb):
            return fused_ops.ode_mlp(x0, tg, list(wb[:3]), list(wb[4:]), tb, sb, 1, 3, 0.8, all_states)

        assert torch.autograd.gradcheck(f, (x0, tb, sb, *ws, *bs), eps=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------
# nn.ODESampler
# ---------------------------------------------------------------------------


def test_sampler_torchcfm_style():
    """torchcfm's models.MLP: four Linear layers, SELU, time last; Euler over 100 steps."""
    net = nn.Sequential(nn.Linear(3, 64), nn.SELU(), nn.Linear(64, 64), nn.SELU(), nn.Linear(64, 64), nn.SELU(),
                        nn.Linear(64, 2))
    sampler = fused_ops.nn.ODESampler(net, method="euler", num_steps=100)
    x0 = torch.randn(256, 2)
    t = torch.linspace(0, 1, 101)
    want = torchdiffeq.odeint(lambda s, y: net(torch.cat([y, s.expand(y.shape[0], 1)], -1)), x0, t, method="euler")
    torch.testing.assert_close(sampler(x0), want[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sampler(x0, t=t), want, rtol=1e-4, atol=1e-4)
    assert set(dict(sampler.named_parameters())) == {f"velocity.{k}" for k in dict(net.named_parameters())}
    assert all(p is q for p, q in zip(sampler.parameters(), net.parameters()))


def test_sampler_flow_matching_style_trains_the_model():
    """flow_matching's 2-D example: five Linear layers, SiLU, time last; midpoint with step_size 0.05.
    One optimiser step through the sampler changes the model's own parameters."""
    net = nn.Sequential(nn.Linear(3, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU(),
                        nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 2))
    sampler = fused_ops.nn.ODESampler(net, method="midpoint", step_size=0.05)
    x0 = torch.randn(64, 2)
    t = torch.tensor([0.0, 0.5, 1.0])
    func = lambda s, y: net(torch.cat([y, s.expand(y.shape[0], 1)], -1))  # noqa: E731
    want = torchdiffeq.odeint(func, x0, t, method="midpoint", options=dict(step_size=0.05))
    torch.testing.assert_close(sampler(x0, t=t), want, rtol=1e-4, atol=1e-5)
    before = net[0].weight.detach().clone()
    opt = torch.optim.SGD(sampler.parameters(), lr=0.1)
    sampler(x0).square().mean().backward()
    opt.step()
    assert not torch.equal(before, net[0].weight)


def test_sampler_keeps_its_grid():
    """The sampler builds its grid and evaluation times once per dtype, device
    and grid settings: a repeated call equals the first and torchdiffeq;
    num_steps and method changed after construction are honoured; a grid first
    built under inference_mode serves a later training call (which saves it
    for backward); float64 after float32 gets a float64 grid."""
    net = nn.Sequential(nn.Linear(3, 16), nn.SiLU(), nn.Linear(16, 2))
    sampler = fused_ops.nn.ODESampler(net, method="midpoint", num_steps=6)
    x0 = torch.randn(8, 2)

    def want(method, steps, x):
        func = lambda s, y: net(torch.cat([y, s.expand(y.shape[0], 1)], -1))  # noqa: E731
        return torchdiffeq.odeint(func, x, torch.linspace(0, 1, steps + 1, dtype=x.dtype), method=method)[-1]

    with torch.inference_mode():
        first = sampler(x0)
    assert len(sampler._grids) == 1
    x = x0.clone().requires_grad_()
    second = sampler(x)
    assert len(sampler._grids) == 1
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    torch.testing.assert_close(second, want("midpoint", 6, x0), rtol=1e-4, atol=1e-5)
    second.square().sum().backward()
    assert x.grad is not None and net[0].weight.grad is not None

    sampler.num_steps = 9
    torch.testing.assert_close(sampler(x0), want("midpoint", 9, x0), rtol=1e-4, atol=1e-5)
    sampler.method = "rk4"
    torch.testing.assert_close(sampler(x0), want("rk4", 9, x0), rtol=1e-4, atol=1e-5)
    sampler.double()
    got = sampler(x0.double())
    assert got.dtype == F64
    torch.testing.assert_close(got, want("rk4", 9, x0.double()), **tol(F64))
    assert len(sampler._grids) == 4


def test_sampler_time_first_embedding_and_cond():
    emb_net = nn.Sequential(nn.Linear(1, 4), nn.Tanh())
    net = [nn.Linear(4 + 2 + 3, 16), nn.ELU(0.5), nn.Linear(16, 2)]
    sampler = fused_ops.nn.ODESampler(net, time="first", time_embedding=lambda s: emb_net(s[:, None]),
                                      method="heun2", num_steps=8)
    x0, cond = torch.randn(10, 2), torch.randn(10, 3)
    t = torch.linspace(0, 1, 9)
    seq = nn.Sequential(*net)
    func = lambda s, y: seq(torch.cat([emb_net(s.reshape(1, 1)).expand(y.shape[0], -1), y, cond], -1))  # noqa
    torch.testing.assert_close(sampler(x0, cond=cond), torchdiffeq.odeint(func, x0, t, method="heun2")[-1],
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layers,match", [
    ([nn.Linear(3, 4), nn.Dropout(), nn.Linear(4, 2)], r"layer 1 \(Dropout\) is not supported"),
    ([nn.Linear(3, 4), nn.ReLU()], r"layer 1 \(ReLU\): the last layer must be a Linear"),
    ([nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)], r"layer 3 \(Tanh\) differs"),
    ([nn.Linear(3, 4), nn.Linear(4, 2)], r"layer 1 \(Linear\) follows a Linear"),
    ([nn.LayerNorm(3), nn.Linear(3, 2)], r"layer 0 \(LayerNorm\) is not supported"),
    ([nn.Linear(3, 4), nn.Softplus(threshold=5), nn.Linear(4, 2)], r"threshold 5"),
])
def test_sampler_refuses_unsupported_layers(layers, match):
    with pytest.raises(ValueError, match=match):
        fused_ops.nn.ODESampler(layers)


# ---------------------------------------------------------------------------
# Bad inputs: the Python layer, and the op (CPU and meta messages identical)
# ---------------------------------------------------------------------------


def _fn_args(**changes):
    x0 = torch.randn(4, 2, dtype=F64)
    ws, bs = make_mlp(2, [6], 1)
    kw = dict(x0=x0, t=torch.linspace(0, 1, 3, dtype=F64), weights=ws, biases=bs)
    kw.update(changes)
    return kw


@pytest.mark.parametrize("changes,match", [
    (dict(t=torch.zeros(0, dtype=F64)), r"t must hold at least one time"),
    (dict(t=torch.tensor([0.0, 0.5, 0.4, 1.0], dtype=F64)), r"t must be strictly increasing or strictly decreasing"),
    (dict(t=torch.tensor([0.0, 0.0, 1.0], dtype=F64)), r"t must be strictly"),
    (dict(step_size=0.0), r"step_size must be a positive number, got 0.0"),
    (dict(step_size=-0.1), r"step_size must be a positive number"),
    (dict(method="dopri5"), r"method must be one of euler"),
    (dict(activation="mish"), r"activation must be one of silu"),
    (dict(time="middle"), r"time must be 'first', 'last' or 'none'"),
    (dict(weights=make_mlp(2, [6], 2)[0]), r"weights\[0\] must have 3 input columns"),
])
def test_function_bad_inputs(changes, match):
    kw = _fn_args(**{k: v for k, v in changes.items() if k in ("x0", "t", "weights", "biases")})
    opts = {k: v for k, v in changes.items() if k not in kw}
    with pytest.raises(ValueError, match=match):
        fused_ops.odeint_mlp(kw.pop("x0"), kw.pop("t"), kw.pop("weights"), kw.pop("biases"), **opts)


def _op_args():
    """ode_mlp args: B=4, D=2, layers 2 -> 6 -> 5 -> 2, midpoint over 3 steps."""
    ws, bs = make_mlp(2, [6, 5], 0)
    return [torch.randn(4, 2, dtype=F64), torch.linspace(0, 1, 4, dtype=F64), ws, bs[1:],
            torch.randn(6, 6, dtype=F64), torch.randn(4, 6, dtype=F64), 1, 0, 0.0, True]


def _set(i, fn):
    def apply(a):
        a = list(a)
        a[i] = fn(a[i])
        return a
    return apply


def _set_list(i, j, fn):
    def apply(a):
        a = list(a)
        a[i] = list(a[i])
        a[i][j] = fn(a[i][j])
        return a
    return apply


OP_BAD = [
    ("grid_empty", _set(1, lambda t: t[:0]), r"^t_grid must hold at least one time"),
    ("grid_2d", _set(1, lambda t: t[None]), r"^t_grid must be a 1-D tensor"),
    ("no_layers", _set(2, lambda w: []), r"^weights must hold 1 to 8 Linear weights, got 0"),
    ("nine_layers", _set(2, lambda w: w + [w[-1]] * 6), r"^weights must hold 1 to 8 Linear weights, got 9"),
    ("biases_count", _set(3, lambda b: b[:1]), r"^biases must hold one bias per layer after the first \(2\), got 1"),
    ("sample_bias_rows", _set(5, lambda t: t[:3]), r"^sample_bias\.shape\[0\] must be 4"),
    ("grid_dtype", _set(1, lambda t: t.float()), r"^t_grid must have the same dtype as x0"),
]


def _message(fn):
    with pytest.raises(RuntimeError) as e:
        fn()
    return str(e.value).splitlines()[0]


@pytest.mark.parametrize("modify,match", [b[1:] for b in OP_BAD], ids=[b[0] for b in OP_BAD])
def test_op_bad_inputs_cpu_and_meta(modify, match):
    """What the op table's flat rows cannot express (tests/op_table/ode_mlp.py
    has the per-tensor rows): the grid, the lists' lengths, sample_bias, the codes."""
    import re

    args = modify(_op_args())
    cpu = _message(lambda: torch.ops.fused_ops.ode_mlp(*args))
    assert re.search(match, cpu), cpu
    meta = [[t.to("meta") for t in a] if isinstance(a, list) else a.to("meta") if isinstance(a, torch.Tensor) else a
            for a in args]
    assert _message(lambda: torch.ops.fused_ops.ode_mlp(*meta)) == cpu


def test_op_non_monotone_grid_cpu():
    args = _op_args()
    args[1] = torch.tensor([0.0, 0.5, 0.4, 1.0], dtype=F64)
    with pytest.raises(RuntimeError, match=r"t_grid must be strictly increasing or strictly decreasing"):
        torch.ops.fused_ops.ode_mlp(*args)


# ---------------------------------------------------------------------------
# opcheck, compile, empty batch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_with_sample_bias(requires_grad, device):
    """opcheck with a sample_bias and four layers (the op table's rows have neither)."""
    args = _op_args()
    args = [[t.to(device).requires_grad_(requires_grad) for t in a] if isinstance(a, list)
            else a.to(device).requires_grad_(requires_grad) if isinstance(a, torch.Tensor) and a is not args[1]
            else a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(torch.ops.fused_ops.ode_mlp.default, tuple(args))
    if not requires_grad:
        states = torch.ops.fused_ops.ode_mlp(*args)
        bwd = (torch.randn_like(states), states, *args[:9])
        torch.library.opcheck(torch.ops.fused_ops.ode_mlp_backward.default, bwd)


def test_empty_batch_and_single_time(device):
    ws, bs = make_mlp(2, [6], 1, device=device, requires_grad=True)
    x0 = torch.randn(0, 2, dtype=F64, device=device, requires_grad=True)
    out = fused_ops.odeint_mlp(x0, torch.linspace(0, 1, 3, dtype=F64, device=device), ws, bs)
    assert out.shape == (3, 0, 2)
    out.sum().backward()
    assert ws[0].grad is not None and not ws[0].grad.any()
    x1 = torch.randn(3, 2, dtype=F64, device=device)
    assert torch.equal(fused_ops.odeint_mlp(x1, torch.zeros(1, dtype=F64, device=device), ws, bs)[0], x1)


# ---------------------------------------------------------------------------
# CUDA: every forward path against the CPU in float64, graph capture
# ---------------------------------------------------------------------------

_FUSED_SIZES = [(1, 1, [3]), (37, 2, [64, 64, 64]), (1000, 5, [33, 17]), (17, 3, [700, 700])]
# stepwise runs any size when forced.
_PATH_SIZES = ([(p, s) for p in ("shared", "general") for s in _FUSED_SIZES]
               + [("stepwise", (1000, 5, [256, 256])), ("stepwise", (600, 2, [512, 512, 512]))])


@requires_cuda
@pytest.mark.parametrize("path,size", _PATH_SIZES)
@pytest.mark.parametrize("method", ["euler", "rk4"])
def test_cuda_paths_match_cpu(path, size, method):
    B, D, widths = size
    x0 = torch.randn(B, D, dtype=F64)
    ws, bs = make_mlp(D, widths, 1)
    t = torch.linspace(0, 1, 6, dtype=F64)
    want = fused_ops.odeint_mlp(x0, t, ws, bs, method=method, activation="gelu")
    cu = lambda v: [w.cuda() for w in v]  # noqa: E731
    with _paths.force("ode_mlp", path):
        got = fused_ops.odeint_mlp(x0.cuda(), t.cuda(), cu(ws), cu(bs), method=method, activation="gelu")
        assert _paths.last("ode_mlp") == path
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)


def test_readme_examples_run():
    """The README's ODE sampler block runs as written (CPU)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text[text.index("### ODE sampler for your own velocity network"):]
    start = block.index("```python\n") + len("```python\n")
    code = block[start:block.index("```\n", start)]
    scope = {}
    exec("import torch\n" + code, scope)  # noqa: S102
    assert scope["x1"].shape == (64, 2) and scope["traj"].shape == (5, 1024, 2)
    assert scope["classes"].weight.grad is not None


@pytest.mark.parametrize("grid", [dict(num_steps=7), dict(step_size=0.13), dict(step_size=0.1, t0=1.0, t1=0.0),
                                  dict(num_steps=5, t0=1.0, t1=0.2)])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
def test_sampler_default_grid_is_torchdiffeqs_and_compiles(grid, dtype, device):
    """The sampler's own grid (no t given) is torchdiffeq's for linspace(t0, t1, n + 1)
    or [t0, t1] with step_size, built without a host read: compile(fullgraph=True) traces it."""
    torch._dynamo.reset()
    net = nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 2)).to(device=device, dtype=dtype)
    sampler = fused_ops.nn.ODESampler(net, method="midpoint", **grid)
    x0 = torch.randn(20, 2, device=device, dtype=dtype)
    t0, t1 = grid.get("t0", 0.0), grid.get("t1", 1.0)
    t = torch.linspace(t0, t1, grid["num_steps"] + 1 if "num_steps" in grid else 2, device=device, dtype=dtype)
    func = lambda s, y: net(torch.cat([y, s.expand(y.shape[0], 1)], -1))  # noqa: E731
    opts = dict(step_size=grid["step_size"]) if "step_size" in grid else None
    want = torchdiffeq.odeint(func, x0, t, method="midpoint", options=opts)[-1]
    got = sampler(x0)
    torch.testing.assert_close(got, want, **tol(dtype))
    compiled = torch.compile(sampler, fullgraph=True)(x0)
    # Inductor may contract the stage times' t0 + dt * c into an FMA on CUDA.
    torch.testing.assert_close(compiled, got, rtol=1e-6 if dtype == F32 else 1e-14, atol=1e-6 if dtype == F32 else 1e-14)


# ---------------------------------------------------------------------------
# CUDA tiled path (3xTF32 tensor cores): forced, float32 against float64
# ---------------------------------------------------------------------------

# (B, D, hidden widths, activation): depth 1..6, odd D and widths, ragged
# tiles, an in-place layer of two passes (300 -> 300) and a narrower one
# after it (stale columns), a wide single hidden layer at D=1, width 512
# (two weight-chunk stages instead of three).
_TILED_SHAPES = [
    (1, 1, [3], "silu"), (37, 3, [33, 17], "gelu"), (100, 2, [64, 64, 64], "selu"), (65, 1, [420], "tanh"),
    (70, 2, [], "silu"), (33, 5, [40], "softplus"), (129, 2, [300, 300, 40], "elu"),
    (64, 3, [17, 33, 65, 31], "leaky_relu"), (40, 4, [32, 32, 32, 32, 32], "gelu_tanh"), (31, 64, [256, 256], "sigmoid"),
    (45, 2, [512, 512, 512], "relu"),  # two weight-chunk stages
]


def _tiled_run(B, D, widths, act, method, steps=3, all_states=True, cond=False, down=False):
    """The op forced onto the tiled path in float32 (output memory poisoned
    with NaN first), the CPU op in float32 and in float64: the float32
    errors against float64."""
    from fused_test_utils import poison_allocator

    stages = (1, 2, 2, 3, 4)[METHODS.index(method)]
    ws, bs = make_mlp(D, widths)
    H0 = ws[0].shape[0]
    x0 = torch.randn(B, D, dtype=F64)
    tb = torch.randn(steps * stages, H0, dtype=F64) * 0.3
    sb = torch.randn(B, H0, dtype=F64) * 0.3 if cond else None
    m = max(steps - 1, 0).bit_length()
    t = torch.arange(steps + 1, dtype=F64) * 2.0**-m  # exact in float32
    if down:
        t = t.flip(0)
    code, p = ACTS.index(act), PARAMS.get(act, 0.0)

    def op(dtype, device):
        cv = lambda v: v.to(device=device, dtype=dtype) if v is not None else None  # noqa: E731
        return torch.ops.fused_ops.ode_mlp(cv(x0), cv(t), [cv(w) for w in ws], [cv(b) for b in bs[1:]], cv(tb),
                                           cv(sb), METHODS.index(method), code, p, all_states)

    exact, ref32 = op(F64, "cpu"), op(F32, "cpu")
    poison_allocator("cuda", F32, [(steps + 1 if all_states else 1) * B * D])
    with _paths.force("ode_mlp", "tiled"):
        got = op(F32, "cuda")
        assert _paths.last("ode_mlp") == "tiled"
        again = op(F32, "cuda")
    assert torch.equal(got, again), "not bitwise reproducible"
    assert got.shape == exact.shape and torch.isfinite(got).all(), "unwritten (NaN) or non-finite outputs"
    err = (got.cpu().double() - exact).abs().max().item()
    err32 = (ref32.double() - exact).abs().max().item()
    floor = 8 * 2.0**-23 * max(exact.abs().max().item(), 1.0)
    assert err <= 4 * err32 + floor, (err, err32, floor)


@requires_cuda
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", _TILED_SHAPES, ids=lambda s: f"B{s[0]}-D{s[1]}-{'x'.join(map(str, s[2])) or 'L1'}")
def test_cuda_tiled_matches_float64(shape, method):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the tiled path needs compute capability 8.0")
    B, D, widths, act = shape
    _tiled_run(B, D, widths, act, method)


@requires_cuda
@pytest.mark.parametrize("all_states", [True, False])
@pytest.mark.parametrize("cond", [False, True], ids=["no_cond", "sample_bias"])
@pytest.mark.parametrize("down", [False, True], ids=["up", "down"])
@pytest.mark.parametrize("shape", [(37, 3, [33, 17], "gelu"), (129, 2, [300, 300, 40], "elu")],
                         ids=["B37-33x17", "B129-300x300x40"])
def test_cuda_tiled_options(shape, all_states, cond, down):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the tiled path needs compute capability 8.0")
    B, D, widths, act = shape
    _tiled_run(B, D, widths, act, "rk4", steps=4, all_states=all_states, cond=cond, down=down)


@requires_cuda
@pytest.mark.parametrize("size,dtype,want", [
    ((256, 2, [64, 64, 64]), F32, "tiled"), ((4096, 64, [256, 256]), F32, "tiled"),
    ((1024, 2, [512, 512, 512, 512]), F32, "stepwise"), ((4096, 2, [512, 512, 512, 512]), F32, "tiled"),
    ((32768, 2, [64, 64, 64]), F32, "stepwise"), ((600, 2, [600, 600]), F32, "stepwise"),
    ((256, 2, [64, 64, 64]), F64, "shared"),
], ids=["f32-small", "f32-seed", "f32-flow-matching-few-tiles", "f32-flow-matching", "f32-narrow-many-rows",
        "f32-too-wide", "f64"])
def test_cuda_tiled_natural_choice(size, dtype, want):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the tiled path needs compute capability 8.0")
    B, D, widths = size
    ws, bs = make_mlp(D, widths, 1, dtype=dtype, device="cuda")
    x0 = torch.randn(B, D, dtype=dtype, device="cuda")
    fused_ops.odeint_mlp(x0, torch.linspace(0, 1, 3, dtype=dtype, device="cuda"), ws, bs, method="midpoint")
    assert _paths.last("ode_mlp") == want
