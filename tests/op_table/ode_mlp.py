"""op_cases entry of ode_mlp: sizes (B, D, H, steps, method, activation).

The op's schema takes its layers as lists (``Tensor?[] weights, biases``);
the table sees a three-layer field as flat tensors named as the op's errors
name them, ``x0, weights[0..2], biases[0..1], time_bias`` (``[H, D]``,
``[H, H]``, ``[D, H]``), and ``OdeCase.op_args`` regroups them into the op's
arguments, with the grid ``t_grid = k * 2^-m`` (k = 0..steps, 2^m >= steps) made from the
size in ``x0``'s dtype and on its device (not a table argument: the op has no
gradient for it) and ``sample_bias=None`` (optional: a None there is valid;
tests/test_ode_mlp.py covers the conditioning).  The
scalars are ``(method, activation, act_param, all_states=True)``.
"""

from dataclasses import dataclass

import torch

import fused_ops
from fused_ops.ops import _ode
from fused_test_utils import arg_modifier
from op_table.base import (
    F32, F32_ULP, F64, Accuracy, Bad, BwdBad, OpCase, PathCase, every, max_abs, misaligned, set_arg, strided,
    transposed,
)

ARG_NAMES = ("x0", "weights[0]", "weights[1]", "weights[2]", "biases[0]", "biases[1]", "time_bias")
_STAGES = (1, 2, 2, 3, 4)
_PARAM = {2: 0.1, 3: 0.8, 7: 1.5}  # leaky_relu slope, elu alpha, softplus beta


def _scalars(s):
    return (s[4], s[5], _PARAM.get(s[5], 0.0), True)


def _uniform_grid(steps, dtype, device):
    """steps + 1 times spaced 2^-m apart (2^m >= steps): exact in every float
    dtype, so a float16 or float32 call and its float64 reference integrate
    over the same grid."""
    m = max(steps - 1, 0).bit_length()
    return torch.arange(steps + 1, dtype=F64, device=device).mul_(2.0**-m).to(dtype)


def _grid(size, like):
    return _uniform_grid(size[3], like.dtype if like is not None else F32, like.device if like is not None else "cpu")


def _group(args, size):
    x0, w0, w1, w2, b1, b2, tb = args
    like = x0 if isinstance(x0, torch.Tensor) else w0
    return (x0, _grid(size, like), [w0, w1, w2], [b1, b2], tb, None)


@dataclass(frozen=True)
class OdeCase(OpCase):
    def op_args(self, args, size, scalars=None):
        return (*_group(args, size), *(self.scalars(size) if scalars is None else scalars))

    def bwd_op_args(self, a):
        """``a`` = (grad_states, x0, weights[0..2], biases[0..1], time_bias, states, method,
        activation, act_param): flat, so the contract's layouts and device moves reach every tensor."""
        grad_states, x0, w0, w1, w2, b1, b2, tb, states, *scalars = a
        like = x0 if isinstance(x0, torch.Tensor) else w0
        steps = (states if states is not None else grad_states).shape[0] - 1
        t = _uniform_grid(steps, like.dtype, like.device)
        return (grad_states, states, x0, t, [w0, w1, w2], [b1, b2], tb, None, *scalars)


def _make(s, dtype=F32, device="cpu", requires_grad=False, scale=1.0):
    B, D, H, steps, method = s[:5]
    g = lambda *shape, k=1.0: (torch.randn(*shape, dtype=dtype, device=device) * k)  # noqa: E731
    args = [g(B, D), g(H, D, k=scale / D**0.5), g(H, H, k=scale / H**0.5), g(D, H, k=scale / H**0.5),
            g(H, k=0.1), g(D, k=0.1), g(steps * _STAGES[method], H, k=0.3)]
    return [a.requires_grad_(requires_grad) for a in args]


def _reference(x0, t, weights, biases, tb, sb, method, act, p, all_states):
    """The op's program in plain PyTorch (csrc/ode_mlp.h), three layers; the op's grouped arguments."""
    (w0, w1, w2), (b1, b2) = weights, biases
    names = list(_ode.METHODS)
    name, act_name = names[method], list(_ode.ACTIVATIONS)[act]
    f = _ode._TORCH_ACTS[act_name]
    steps = t.shape[0] - 1
    a_tab = {"euler": [[]], "midpoint": [[], [0.5]], "heun2": [[], [1.0]], "heun3": [[], [1 / 3], [0.0, 2 / 3]],
             "rk4": [[], [1 / 3], [-1 / 3, 1.0], [1.0, -1.0, 1.0]]}[name]
    b_tab = {"euler": [1.0], "midpoint": [0.0, 1.0], "heun2": [0.5, 0.5], "heun3": [0.25, 0.0, 0.75],
             "rk4": [0.125, 0.375, 0.375, 0.125]}[name]
    s = len(b_tab)
    y, out = x0, [x0]
    for k in range(steps):
        dt = t[k + 1] - t[k]
        ks = []
        for i in range(s):
            yi = y
            if i:
                yi = y + dt * sum(c * kj for c, kj in zip(a_tab[i], ks) if c != 0.0)
            a0 = yi @ w0.t() + tb[k * s + i]
            h = f(a0 + sb if sb is not None else a0, p)
            h = f(h @ w1.t() + b1, p)
            ks.append(h @ w2.t() + b2)
        y = y + dt * sum(c * kj for c, kj in zip(b_tab, ks) if c != 0.0)
        out.append(y)
    return torch.stack(out) if all_states else y[None]


def _module(device):
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.SiLU(), torch.nn.Linear(16, 3)).to(device)
    fused = fused_ops.nn.ODESampler(net, method="midpoint", num_steps=6)

    class Loop(torch.nn.Module):  # torchdiffeq's midpoint written out
        def forward(self, x):
            y, dt = x, 1.0 / 6
            for k in range(6):
                def v(t, z):
                    return net(torch.cat([z, z.new_full((z.shape[0], 1), t)], -1))
                f0 = v(k * dt, y)
                y = y + dt * v(k * dt + 0.5 * dt, y + f0 * (0.5 * dt))
            return y

    return fused, Loop(), (torch.randn(10, 3, device=device),)


def _bad(**changes):
    return arg_modifier(ARG_NAMES, **changes)


def _bwd_args(case, size, dtype, device, grads=(True,)):
    args = case.inputs(size, dtype=dtype, device=device)
    states = torch.ops.fused_ops.ode_mlp(*case.op_args(args, size))
    return (torch.randn_like(states), *args, states, *case.scalars(size)[:3])


def _grad32_check(case, got, ref32, exact, ctx):
    for name, g, w, e in zip(case.arg_names, got, ref32, exact):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"grad {n}: {m}")
        # Root-sum-square errors against float64: the gradients of the biases
        # are sums over the batch whose largest single error swings with the
        # draw; the whole tensor's error is the stable measure.
        fused_err = (g.double() - e).norm().item()
        eager_err = (w.double() - e).norm().item()
        assert fused_err <= max(2 * eager_err, 8 * F32_ULP * e.norm().item()), (name, fused_err, eager_err)


def _gradcheck_inputs(case, size, device):
    return case.inputs(size, dtype=F64, device=device, requires_grad=True)


# (B, D, H, steps, method, activation): every method and activation, ragged tiles.
SIZES = (
    (5, 2, 16, 4, 0, 0), (17, 3, 20, 3, 1, 1), (33, 2, 64, 5, 2, 2), (9, 4, 33, 2, 3, 3), (70, 2, 32, 3, 4, 4),
    (16, 5, 7, 2, 1, 5), (3, 1, 9, 4, 0, 6), (40, 2, 24, 2, 4, 7), (1, 3, 5, 1, 3, 8), (130, 2, 48, 2, 1, 9),
)

ODE_MLP = OdeCase(
    name="ode_mlp",
    fn=fused_ops.ode_mlp,
    packet=torch.ops.fused_ops.ode_mlp,
    reference=_reference,
    make=_make,
    arg_names=ARG_NAMES,
    out_names=("states",),
    tensor_dims=(0, 1, 2, 3),
    func_transforms=False,
    out_shapes=lambda s: [(s[3] + 1, s[0], s[1])],
    scalars=_scalars,
    size_id=lambda s: "B{}-D{}-H{}-S{}-{}-{}".format(*s[:4], list(_ode.METHODS)[s[4]], list(_ode.ACTIVATIONS)[s[5]]),
    match_sizes=SIZES,
    float64_tight=(((9, 3, 20, 4, 4, 0), 1e-12),),
    accuracy=tuple(Accuracy(s, floor_ulps=4, combine="max", scale_min=0.0) for s in
                   ((70, 2, 32, 3, 4, 4), (33, 2, 64, 5, 2, 0))),
    poison_sizes=((5, 2, 16, 4, 0, 0), (70, 2, 32, 3, 4, 4)),
    poison_numels=lambda s: (s[0] * s[1], s[0] * s[2]),
    layouts={"transposed": (every(transposed), "noncontig"), "strided": (every(strided), "noncontig"),
             "misaligned": (every(misaligned), "misaligned")},
    layout_sizes=((17, 3, 20, 3, 1, 1), (70, 2, 32, 3, 4, 0)),
    cpu_rounding_layouts=frozenset({"misaligned"}),
    empty_size=(0, 2, 8, 3, 1, 0),
    opcheck_sizes=((1, 1, 3, 1, 0, 0), (5, 3, 10, 3, 4, 3)),
    meta_size=(11, 4, 9, 5, 1, 0),
    module=_module,
    compile_size=(6, 3, 12, 3, 1, 0),
    compile_loss=lambda o: (o[0] ** 2).sum(),
    compile_tol=dict(rtol=1e-4, atol=1e-5),
    determinism_sizes=((70, 2, 32, 3, 4, 4), (300, 3, 40, 2, 1, 0)),
    thread_size=(300, 3, 40, 2, 1, 0),
    bad_size=(6, 4, 10, 2, 1, 0),
    bad_inputs=(
        Bad("x0_1d", _bad(x0=lambda t: t[0]), "x0", r"2-D"),
        Bad("x0_D0", _bad(**{"x0": lambda t: t[:, :0], "weights[0]": lambda t: t[:, :0],
                             "weights[2]": lambda t: t[:0], "biases[1]": lambda t: t[:0]}), "x0", r"D >= 1"),
        Bad("w0_cols", _bad(**{"weights[0]": lambda t: t[:, :3]}), "weights[0]",
            r"weights\[0\]\.shape\[1\] must be 4"),
        Bad("w1_width_mismatch", _bad(**{"weights[1]": lambda t: t[:, :9]}), "weights[1]",
            r"weights\[1\]\.shape\[1\] must be 10"),
        Bad("w2_rows", _bad(**{"weights[2]": lambda t: t[:3]}), "weights[2]", r"weights\[2\]\.shape\[0\] must be 4"),
        Bad("b1_size", _bad(**{"biases[0]": lambda t: t[:9]}), "biases[0]", r"biases\[0\]\.shape\[0\] must be 10"),
        Bad("b2_2d", _bad(**{"biases[1]": lambda t: t[None]}), "biases[1]", r"biases\[1\] must be a 1-D"),
        Bad("time_bias_rows", _bad(time_bias=lambda t: t[:3]), "time_bias", r"time_bias\.shape\[0\] must be 4"),
        Bad("x0_int64", _bad(x0=lambda t: t.long()), "x0", r"float"),
        Bad("w1_float64", _bad(**{"weights[1]": lambda t: t.double()}), "weights[1]",
            r"weights\[1\] must have the same dtype as x0"),
        Bad("method", _bad(), "method", r"method must be 0 \.\. 4", scalars=(7, 0, 0.0, True)),
        Bad("activation", _bad(), "activation", r"activation must be 0 \.\. 9", scalars=(1, 10, 0.0, True)),
    ),
    stream_sizes=((70, 2, 32, 3, 4, 4),),
    graph_sizes=((70, 2, 32, 3, 4, 4),),
    cuda_cpu_float64=(((50, 3, 33, 4, 4, 3), 1e-12, 1e-12),),
    isa_sizes=((17, 3, 20, 3, 1, 1),),
    gradcheck_sizes=(((3, 2, 5, 2, 1, 3), False), ((2, 2, 4, 1, 4, 0), False)),
    gradcheck_inputs=_gradcheck_inputs,
    gradcheck_tol=dict(eps=1e-6, atol=1e-8, rtol=1e-6),
    gradcheck_alone_size=(3, 2, 5, 2, 3, 7),
    grad64_sizes=tuple((s, ((0,),), {}) for s in ((17, 3, 20, 3, 1, 1), (70, 2, 32, 3, 4, 4), (9, 4, 33, 2, 3, 3))),
    grad64_tol=(1e-10, 1e-12),
    grad32_sizes=tuple((s, (0,)) for s in ((33, 2, 64, 5, 2, 0), (130, 2, 48, 2, 1, 9))),
    grad32_check=_grad32_check,
    double_backward_match="does not support double backward",
    bwd=torch.ops.fused_ops.ode_mlp_backward.default,
    bwd_args=_bwd_args,
    bwd_grad_names=("grad_states",),
    bwd_upstream_index=0,
    bwd_opcheck_sizes=((1, 1, 3, 1, 0, 0), (5, 3, 10, 3, 4, 3)),
    bwd_meta_size=(11, 4, 9, 2, 1, 0),
    bwd_determinism_sizes=((70, 2, 32, 3, 4, 4),),
    bwd_bad_size=(4, 3, 7, 2, 1, 0),
    bwd_bad=(
        BwdBad("grad_states-shape", set_arg(0, lambda a: a[0][:, :2].contiguous()),
               r"grad_states must have the shape \[num_steps \+ 1, B, D\]"),
        BwdBad("states-None", set_arg(8, lambda a: None), r"states must be a 3-D tensor"),
        BwdBad("grad_states-dtype", set_arg(0, lambda a: a[0].double()), "grad_states must have the same dtype as x0"),
        BwdBad("grad_states-device", set_arg(0, lambda a: a[0].cpu()), "grad_states must be on the same device as x0",
               cuda_only=True),
    ),
    bwd_empty_size=(0, 3, 7, 2, 1, 0),
    bwd_stream_size=(70, 2, 32, 3, 4, 4),
    bwd_graph_size=(70, 2, 32, 3, 4, 4),
    bwd_cuda_cpu_sizes=((70, 2, 32, 3, 4, 4), (9, 4, 33, 2, 3, 3)),
    paths=(
        PathCase("split", (8, 64, 256, 3, 4, 0), note="the seed field, 4 blocks per row (test_ode_mlp_cluster.py)"),
        PathCase("split", (60, 64, 256, 2, 1, 0), note="2 blocks per row (2B <= 132 SMs < 4B)"),
        PathCase("cluster", (8, 3, 33, 3, 4, 3), note="small batch, odd width (tests/test_ode_mlp_cluster.py: more)"),
        PathCase("cluster", (32, 2, 64, 5, 2, 2), note="its largest batch"),
        PathCase("tiled", (70, 2, 32, 3, 4, 4), note="3xTF32 tiles, a ragged last tile, rk4", bound=4),
        PathCase("tiled", (33, 3, 33, 2, 3, 3), note="odd widths (33 -> 64 padded k), heun3", bound=4),
        PathCase("tiled", (1, 1, 300, 2, 1, 5), note="one row; an in-place layer of two passes", bound=4),
        PathCase("tiled", (40, 2, 512, 2, 1, 0), note="two weight-chunk stages (width 512)", bound=4),
        PathCase("stepwise", (520, 3, 256, 2, 4, 4), note="just above its threshold"),
        PathCase("stepwise", (512, 2, 256, 1, 1, 1), F64),
        PathCase("shared", (70, 2, 32, 3, 4, 4)),
        PathCase("shared", (17, 3, 20, 3, 1, 1), F64),
        PathCase("general", (70, 2, 32, 3, 4, 4), note="the general path applies everywhere"),
        PathCase("general", (20, 2, 2000, 1, 1, 0), note="a working set beyond shared memory"),
    ),
    natural=(PathCase("tiled", (70, 2, 32, 3, 4, 4)), PathCase("cluster", (1, 1, 3, 1, 0, 0)),
             PathCase("split", (8, 64, 256, 2, 0, 0), note="the seed field at small B"),
             PathCase("stepwise", (600, 2, 600, 1, 1, 0), note="an in-place layer too wide for tiled"),
             PathCase("shared", (70, 2, 32, 3, 4, 4), F64), PathCase("shared", (1, 1, 3, 1, 0, 0), F64),
             PathCase("shared", (17, 3, 20, 3, 1, 1), F64, note="split, cluster and tiled are float32 only"),
             PathCase("general", (20, 2, 8000, 1, 0, 0))),
    refused=(PathCase("shared", (20, 2, 8000, 1, 0, 0)), PathCase("cluster", (33, 2, 16, 1, 0, 0), note="B > 32"),
             PathCase("cluster", (8, 2, 16, 1, 0, 0), F64, note="float32 only"),
             PathCase("tiled", (17, 3, 20, 3, 1, 1), F64),
             PathCase("tiled", (20, 2, 600, 1, 1, 0), note="an in-place layer wider than 512"),
             PathCase("split", (8, 64, 256, 1, 0, 1), note="SiLU only"),
             PathCase("split", (8, 64, 128, 1, 0, 0), note="widths 256, 256, 64 only")),
    path_names=("split", "cluster", "stepwise", "tiled", "shared", "general"),
    sm90_paths=frozenset({"split", "cluster"}),
    bwd_path_names=("stepwise",),
    bwd_paths=(PathCase("stepwise", (70, 2, 32, 3, 4, 4)),),
    bwd_natural=(PathCase("stepwise", (70, 2, 32, 3, 4, 4)),),
)
