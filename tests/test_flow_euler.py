"""Tests of torch.ops.fused_ops.flow_euler and fused_ops.nn.FlowODE against the
reference program (DESIGN.md sections 2.2, 3 and 4).

CUDA kernel paths and the sizes that reach them (csrc/cuda/flow_euler.cu;
B limits as on an H200, 132 SMs):
  split    float32, D = 64 and H = 256 exactly, sm_90: four blocks per row
           for B <= a quarter of the SM count (B = 1, 8, 33), two for B <=
           half of it (B = 34, 40, 66)
  row      the same sizes, B <= the SM count and the block's ~200 KB of
           shared memory available: B = 67, 129
  cluster  float32, sm_90, B <= 32 and the weights fit a cluster's shared
           memory: (B, D, H) = (1, 1, 3), (3, 5, 20), (32, 100, 130),
           (32, 64, 300) (long ragged k-segments)
  wgmma    float32, D = 64 and H = 256, sm_90 with the sm_90a kernels built,
           B above the row path: B = 133, 4096 (a CTA pair per 64 rows)
  tiled    float32, sm_80+, otherwise when a 32-row tile's activations fit
           shared memory: (129, 100, 130), (33, 5, 20), (129, 1, 45), and
           B = 133, 4096 at D=64, H=256 where the wgmma path does not apply
  general  float64, or float32 too large for both: (8, 5, 1100), (40, 3, 1100)
The lists below contain all of them, so one CUDA run of this file covers
every path.
"""


import pytest
import torch
from torch import nn

import fused_ops
from fused_ops import reference
from fused_test_utils import (
    DTYPES,
    Doubled,
    arg_modifier,
    check_error_names,
    outputs_per_thread_count,
    requires_cuda,
    run_with_baseline_isa,
    sync,
    tol,
)

OP = torch.ops.fused_ops.flow_euler.default
ENTRIES = [
    pytest.param(torch.ops.fused_ops.flow_euler, id="torch.ops"),
    pytest.param(fused_ops.flow_euler, id="wrapper"),
]
ARG_NAMES = ("x0", "w1", "b1", "w2", "b2", "w3", "b3")


def make_args(B, D, H, dtype=torch.float32, device="cpu", x_scale=1.0, requires_grad=False):
    """``(x0, w1, b1, w2, b2, w3, b3)`` drawn like ``nn.Linear``'s default
    initialisation (uniform in +-1/sqrt(fan_in)) from the global generator on
    the CPU, then moved to ``device``: a seed gives the same values everywhere."""

    def linear(out_f, in_f):
        bound = 1.0 / in_f**0.5
        w = (torch.rand(out_f, in_f, dtype=dtype) * 2 - 1) * bound
        b = (torch.rand(out_f, dtype=dtype) * 2 - 1) * bound
        return w, b

    x0 = torch.randn(B, D, dtype=dtype) * x_scale
    w1, b1 = linear(H, D + 1)
    w2, b2 = linear(H, H)
    w3, b3 = linear(D, H)
    args = [t.to(device) for t in (x0, w1, b1, w2, b2, w3, b3)]
    if requires_grad:
        args = [t.requires_grad_() for t in args]
    return args


def ref(args, steps):
    return reference.flow_euler(*args, steps)


# (B, D, H, steps): every required B, D, steps value, hidden widths that are
# not multiples of 32, and the sizes that reach each CUDA path (module doc).
CASES = [
    (8, 64, 256, 32),  # default size: split, 4 blocks per row
    (1, 64, 256, 1),  # split (4), one cluster
    (33, 64, 256, 2),  # split (4), the most rows
    (34, 64, 256, 2),  # split, 2 blocks per row, the fewest rows
    (66, 64, 256, 2),  # split (2), the most rows
    (67, 64, 256, 2),  # row, the fewest rows
    (129, 64, 256, 3),  # row, a block per SM but three
    (133, 64, 256, 2),  # wgmma on an sm_90a build (tiled otherwise): one row more than an H200 has SMs
    (200, 64, 256, 1),  # wgmma, one step: only the last exchange (x's partner half) is waited for
    (1, 1, 3, 1),  # cluster, smallest
    (3, 5, 20, 2),  # cluster
    (32, 100, 130, 7),  # cluster, largest B
    (32, 64, 300, 3),  # cluster, long ragged k-segments (4 row chunks)
    (8, 64, 256, 100),  # split (4), many steps
    (1, 100, 37, 32),
    (129, 100, 130, 7),  # tiled, ragged last tile
    (33, 5, 20, 2),  # tiled
    (129, 1, 45, 100),  # tiled, D = 1
    (4096, 64, 256, 32),  # wgmma on an sm_90a build (tiled otherwise), large-batch default
    (129, 3, 300, 2),  # tiled, two column passes (the second layer kept in registers)
    (8, 5, 1100, 2),  # general: too large for the cluster
    (40, 3, 1100, 1),  # general: too large for a tile
]


def case_id(c):
    return "B{}-D{}-H{}-S{}".format(*c)


def cases(*sizes):
    return [pytest.param(*c, id=case_id(c)) for c in sizes]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("B,D,H,steps", cases(*CASES))
def test_matches_reference(B, D, H, steps, dtype, device):
    if B == 4096 and dtype == torch.float64 and device == "cpu":
        pytest.skip("covered by the float32 run; float64 at this size is slow on CPU")
    args = make_args(B, D, H, dtype=dtype, device=device)
    got = OP(*args, steps)
    assert got.shape == (B, D) and got.dtype == dtype and got.device == args[0].device
    assert got.is_contiguous()
    torch.testing.assert_close(got, ref(args, steps), **tol(dtype))


def test_functional_reference_is_the_module():
    # reference.flow_euler must be the module's program, bit for bit.
    module = reference.FlowODE(7, 5)
    x = torch.randn(4, 7)
    l1, l2, l3 = module.velocity[0], module.velocity[2], module.velocity[4]
    got = reference.flow_euler(x, l1.weight, l1.bias, l2.weight, l2.bias, l3.weight, l3.bias, 5)
    assert torch.equal(got, module(x))


def _float32_errors(args, steps):
    args64 = [a.double() for a in args]
    exact = ref(args64, steps)
    fused_err = (OP(*args, steps).double() - exact).abs().max().item()
    eager_err = (ref(args, steps).double() - exact).abs().max().item()
    return fused_err, eager_err, exact.abs().max().item()


@pytest.mark.parametrize(
    "B,D,H,steps",
    cases((8, 64, 256, 32), (32, 100, 130, 7), (4096, 64, 256, 32), (129, 100, 130, 100), (8, 5, 1100, 2)),
)
def test_float32_accuracy_vs_float64(B, D, H, steps, device):
    # DESIGN.md 2: no further from a float64 run of the reference than the
    # float32 reference itself is (allow 2x).  The floor of 4 float32 ulps of
    # the largest |x| covers sizes where both errors are a few roundings and
    # the ratio of two tiny numbers means nothing.
    args = make_args(B, D, H, device=device, x_scale=2.0)
    fused_err, eager_err, scale = _float32_errors(args, steps)
    floor = 4 * 2.0**-23 * scale
    assert fused_err <= max(2 * eager_err, floor), (fused_err, eager_err, floor)


def test_float64_is_float64(device):
    # A float32 computation in disguise would be ~1e-7 off.
    args = make_args(9, 6, 40, dtype=torch.float64, device=device)
    torch.testing.assert_close(OP(*args, 10), ref(args, 10), atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------
# Every output element is written; empty batch; layouts
# ---------------------------------------------------------------------------


def _poison(device, dtype, numels):
    nan = float("nan")
    blocks = [torch.full((n,), nan, dtype=dtype, device=device) for n in numels for _ in range(4)]
    if torch.device(device).type == "cuda":
        blocks.append(torch.full((64 << 20,), nan, dtype=torch.float32, device=device))
    sync(device)
    del blocks


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("B,D,H,steps", cases((8, 64, 256, 3), (129, 100, 130, 2), (40, 3, 1100, 1)),
)
def test_output_fully_written(B, D, H, steps, dtype, device):
    args = make_args(B, D, H, dtype=dtype, device=device)
    want = ref(args, steps)
    for _ in range(2):
        _poison(device, dtype, [B * D, B * H])
        got = OP(*args, steps)
        sync(device)
        assert not torch.isnan(got).any(), "output contains NaN from the poisoned allocator"
        torch.testing.assert_close(got, want, **tol(dtype))


def test_empty_batch(device):
    args = make_args(0, 4, 9, device=device)
    out = OP(*args, 3)
    assert out.shape == (0, 4) and out.dtype == torch.float32


LAYOUTS = {
    # Transposed storage of every 2-D tensor (same values, column-major).
    "transposed": lambda t: t.t().contiguous().t() if t.dim() == 2 else t,
    # Every tensor a strided slice of a larger one.
    "strided": lambda t: (torch.stack([t, torch.full_like(t, float("nan"))], -1)[..., 0]),
    # Contiguous, but starting one element into a buffer: not 16-byte aligned
    # (the CUDA split and row paths read weights as float4s only where aligned).
    "misaligned": lambda t: torch.cat([t.new_full((1,), float("nan")), t.flatten()])[1:].view_as(t),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "B,D,H", [(8, 64, 256), (40, 64, 256), (70, 64, 256), (129, 5, 37)], ids=["B8", "B40", "B70", "B129"]
)
def test_non_contiguous_inputs(layout, B, D, H, device):
    args = make_args(B, D, H, device=device)
    odd = [LAYOUTS[layout](a) for a in args]
    if layout == "misaligned":
        assert all(a.is_contiguous() and a.data_ptr() % 16 != 0 for a in odd)
    else:
        assert any(not a.is_contiguous() for a in odd)
    for a, b in zip(odd, args):
        assert torch.equal(a, b)
    got = OP(*odd, 4)
    assert got.is_contiguous()
    if layout == "misaligned" and device == "cpu":
        # The CPU's BLAS rounds differently for weights that do not start on
        # a 64-byte boundary (the op's docstring); the CUDA kernels do not.
        torch.testing.assert_close(got, OP(*args, 4), **tol(torch.float32))
    else:
        assert torch.equal(got, OP(*args, 4))
    torch.testing.assert_close(got, ref(args, 4), **tol(torch.float32))


def test_expanded_input(device):
    # x0 as a stride-0 broadcast of one row.  (Rows are not bitwise equal on
    # the CPU: the BLAS treats a row differently by its position in a block.)
    args = make_args(1, 6, 20, device=device)
    args[0] = args[0].expand(5, 6)
    got = OP(*args, 3)
    torch.testing.assert_close(got, ref(args, 3), **tol(torch.float32))
    torch.testing.assert_close(got, got[:1].expand(5, 6), **tol(torch.float32))


def test_nan_propagates_per_row(device):
    args = make_args(40, 4, 20, device=device)
    args[0][3, 1] = float("nan")
    got = OP(*args, 2)
    assert torch.isnan(got[3]).all()
    ok = torch.ones(40, dtype=torch.bool)
    ok[3] = False
    assert torch.isfinite(got[ok]).all()


# ---------------------------------------------------------------------------
# opcheck, meta, autograd
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,grad",
    [
        pytest.param(torch.float32, False, id="f32"),
        pytest.param(torch.float64, False, id="f64"),
        pytest.param(torch.float64, True, id="f64-requires_grad"),
    ],
)
@pytest.mark.parametrize("B,D,H,steps", cases((1, 1, 3, 1), (5, 3, 10, 3)),
)
def test_opcheck(B, D, H, steps, dtype, grad, device):
    args = make_args(B, D, H, dtype=dtype, device=device, requires_grad=grad)
    result = torch.library.opcheck(OP, (*args, steps))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_meta_tensors():
    args = make_args(11, 4, 9, device="meta")
    out = OP(*args, 5)
    assert out.shape == (11, 4) and out.device.type == "meta" and out.dtype == torch.float32
    assert out.is_contiguous()


def test_gradcheck(device):
    args = make_args(3, 2, 5, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: OP(*a, 3), args, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_grad_matches_reference(device):
    args = make_args(17, 6, 30, dtype=torch.float64, device=device, requires_grad=True)
    c = torch.randn(17, 6, dtype=torch.float64, device=device)
    g_fused = torch.autograd.grad((OP(*args, 8) * c).sum(), args)
    g_ref = torch.autograd.grad((ref(args, 8) * c).sum(), args)
    for name, a, b in zip(ARG_NAMES, g_fused, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"grad {n}: {m}")


def test_grad_of_some_inputs_only(device):
    args = make_args(4, 3, 7, dtype=torch.float64, device=device)
    args[0].requires_grad_()
    (g,) = torch.autograd.grad(OP(*args, 2).sum(), [args[0]])
    x = args[0].detach().requires_grad_()
    (want,) = torch.autograd.grad(ref([x, *args[1:]], 2).sum(), [x])
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------


def test_compile_fullgraph_module(device):
    torch._dynamo.reset()
    module = fused_ops.nn.FlowODE(16, 6).to(device)
    compiled = torch.compile(module, fullgraph=True)  # raises on a graph break
    x = torch.randn(10, 16, device=device)
    got = compiled(x)
    assert torch.equal(got, module(x))
    ref_module = reference.FlowODE(16, 6).to(device)
    ref_module.load_state_dict(module.state_dict())
    torch.testing.assert_close(got, ref_module(x), **tol(torch.float32))


def test_compile_backward(device):
    torch._dynamo.reset()
    args = make_args(6, 4, 12, device=device, requires_grad=True)

    def loss(*a):
        return (torch.ops.fused_ops.flow_euler(*a, 3) ** 2).sum()

    eager = torch.autograd.grad(loss(*args), args)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*args), args)
    for name, a, b in zip(ARG_NAMES, compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")


# ---------------------------------------------------------------------------
# Bitwise determinism
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("B,D,H,steps", cases((8, 64, 256, 32), (4096, 64, 256, 4), (40, 3, 1100, 2)),
)
def test_deterministic_repeated_calls(B, D, H, steps, device):
    args = make_args(B, D, H, device=device)
    first = OP(*args, steps)
    for _ in range(3):
        assert torch.equal(OP(*args, steps), first)


def test_deterministic_across_thread_counts():
    args = make_args(300, 16, 40)  # several CPU row blocks
    results = outputs_per_thread_count(lambda: OP(*args, 5), (1, 2, 3))
    for r in results.values():
        assert torch.equal(r, results[1])


# ---------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------


def _bad(**changes):
    """A modifier of the valid arguments (B=6, D=4, H=10, float32)."""
    return arg_modifier(ARG_NAMES, **changes)


BAD_INPUTS = [
    # (id, modifier, num_steps, argument the message must name, what it must say)
    ("steps_0", _bad(), 0, "num_steps", r"at least 1"),
    ("steps_negative", _bad(), -3, "num_steps", r"at least 1"),
    ("x0_1d", _bad(x0=lambda t: t[0]), 2, "x0", r"2-D"),
    ("x0_3d", _bad(x0=lambda t: t[None]), 2, "x0", r"2-D"),
    ("w1_1d", _bad(w1=lambda t: t[0]), 2, "w1", r"2-D"),
    ("w1_no_time_column", _bad(w1=lambda t: t[:, :4]), 2, "w1", r"\b5\b"),
    ("w1_extra_column", _bad(w1=lambda t: torch.cat([t, t[:, :1]], 1)), 2, "w1", r"\b5\b"),
    ("b1_size", _bad(b1=lambda t: t[:9]), 2, "b1", r"\b10\b"),
    ("b1_2d", _bad(b1=lambda t: t[None]), 2, "b1", r"1-D"),
    ("w2_rows", _bad(w2=lambda t: t[:9]), 2, "w2", r"\b10\b"),
    ("w2_cols", _bad(w2=lambda t: t[:, :9]), 2, "w2", r"\b10\b"),
    ("b2_size", _bad(b2=lambda t: torch.cat([t, t])), 2, "b2", r"\b10\b"),
    ("w3_rows", _bad(w3=lambda t: t[:3]), 2, "w3", r"\b4\b"),
    ("w3_cols", _bad(w3=lambda t: t[:, :9]), 2, "w3", r"\b10\b"),
    ("b3_size", _bad(b3=lambda t: t[:3]), 2, "b3", r"\b4\b"),
    ("b3_0d", _bad(b3=lambda t: t[0]), 2, "b3", r"1-D"),
    ("D_0", _bad(x0=lambda t: t[:, :0], w1=lambda t: t[:, :1], w3=lambda t: t[:0], b3=lambda t: t[:0]), 2,
     "x0", r"D >= 1"),
    ("x0_int64", _bad(x0=lambda t: t.long()), 2, "x0", r"float"),
    ("all_float16", _bad(**{n: (lambda t: t.half()) for n in ARG_NAMES}), 2, "x0", r"float32"),
    ("w2_float64", _bad(w2=lambda t: t.double()), 2, "w2", r"dtype"),
    ("x0_float64", _bad(x0=lambda t: t.double()), 2, "w1", r"dtype"),
]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("modify,steps,arg,expected", [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_inputs(modify, steps, arg, expected, entry, device):
    args = modify(make_args(6, 4, 10, device=device))
    with pytest.raises((RuntimeError, ValueError)) as excinfo:
        entry(*args, steps)
        sync(device)
    check_error_names(excinfo, arg, expected)


@requires_cuda
@pytest.mark.parametrize("cpu_arg", ARG_NAMES)
def test_cpu_cuda_mix(cpu_arg):
    args = make_args(6, 4, 10, device="cuda")
    i = ARG_NAMES.index(cpu_arg)
    args[i] = args[i].cpu()
    with pytest.raises((RuntimeError, ValueError)) as excinfo:
        OP(*args, 2)
        torch.cuda.synchronize()
    check_error_names(excinfo, cpu_arg if cpu_arg != "x0" else "w1", r"device|cuda|cpu")


# ---------------------------------------------------------------------------
# CUDA specifics
# ---------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("B", [8, 4096])
def test_cuda_uses_current_stream(B):
    args = make_args(B, 64, 256, device="cuda")
    want = OP(*args, 4)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _poison("cuda", torch.float32, [B * 64])
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        x = args[0] * 1.0
        out = OP(x, *args[1:], 4)
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@requires_cuda
@pytest.mark.parametrize("B", [8, 4096])
def test_cuda_graph_capture(B):
    args = make_args(B, 64, 256, device="cuda")
    static_x = args[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        OP(static_x, *args[1:], 8)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(static_x, *args[1:], 8)
    new_x = torch.randn_like(static_x)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, OP(new_x, *args[1:], 8))


@requires_cuda
def test_cuda_matches_cpu_float64():
    args = make_args(50, 7, 33, dtype=torch.float64)
    got = OP(*[a.cuda() for a in args], 6).cpu()
    torch.testing.assert_close(got, OP(*args, 6), atol=1e-12, rtol=1e-12)


def test_cpu_baseline_isa_matches_reference(tmp_path):
    """The CPU elementwise passes have an SSE2 baseline and an AVX2 build chosen
    at run time; ATEN_CPU_CAPABILITY=default forces the baseline."""
    run_with_baseline_isa(
        tmp_path,
        'for B, D, H, S in [(3, 5, 37, 3), (70, 16, 40, 2)]:\n'
        '    for dt in (torch.float32, torch.float64):\n'
        '        args = [torch.randn(B, D, dtype=dt), torch.randn(H, D + 1, dtype=dt) / D**0.5,\n'
        '                torch.randn(H, dtype=dt) * 0.1, torch.randn(H, H, dtype=dt) / H**0.5,\n'
        '                torch.randn(H, dtype=dt) * 0.1, torch.randn(D, H, dtype=dt) / H**0.5,\n'
        '                torch.randn(D, dtype=dt) * 0.1]\n'
        '        tol = 1e-4 if dt == torch.float32 else 1e-10\n'
        '        torch.testing.assert_close(fused_ops.flow_euler(*args, S), reference.flow_euler(*args, S),\n'
        '                                   atol=tol, rtol=tol)',
    )


# ---------------------------------------------------------------------------
# The module and convert
# ---------------------------------------------------------------------------


class UserFlow(nn.Module):
    """A user's own copy of the reference module (another class, same structure)."""

    def __init__(self, dim, num_steps, hidden=None):
        super().__init__()
        hidden = hidden or 4 * dim
        self.velocity = nn.Sequential(
            nn.Linear(dim + 1, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, dim)
        )
        self.num_steps = num_steps
        self.register_buffer("dt", torch.tensor(1.0 / num_steps))

    forward = reference.FlowODE.forward


class ReluFlow(UserFlow):
    def __init__(self, dim, num_steps):
        super().__init__(dim, num_steps)
        self.velocity[1] = nn.ReLU()


class NoBiasFlow(UserFlow):
    def __init__(self, dim, num_steps):
        super().__init__(dim, num_steps)
        self.velocity[4] = nn.Linear(4 * dim, dim, bias=False)


class ExtraParamFlow(UserFlow):
    def __init__(self, dim, num_steps):
        super().__init__(dim, num_steps)
        self.scale = nn.Parameter(torch.ones(()))


class WrongShapeFlow(UserFlow):
    def __init__(self, dim, num_steps):
        super().__init__(dim, num_steps)
        self.velocity[4] = nn.Linear(4 * dim, dim + 1)


NON_MATCHING = {"relu": ReluFlow, "no_bias": NoBiasFlow, "extra_param": ExtraParamFlow, "wrong_shape": WrongShapeFlow}


def test_module_construction_under_one_seed_equals_reference():
    torch.manual_seed(123)
    ref_module = reference.FlowODE(6, 4)
    torch.manual_seed(123)
    fused = fused_ops.nn.FlowODE(6, 4)
    assert list(fused.state_dict()) == list(ref_module.state_dict())
    for (n1, a), (n2, b) in zip(fused.state_dict().items(), ref_module.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b), n1
    fused.load_state_dict(ref_module.state_dict(), strict=True)
    ref_module.load_state_dict(fused.state_dict(), strict=True)


@pytest.mark.parametrize("dim,steps", [(1, 1), (5, 3), (64, 32)])
def test_module_forward_matches_reference(dim, steps, device):
    ref_module = reference.FlowODE(dim, steps).to(device)
    fused = fused_ops.nn.FlowODE.from_reference(ref_module)
    x = torch.randn(8, dim, device=device)
    torch.testing.assert_close(fused(x), ref_module(x), **tol(torch.float32))


def test_module_follows_replaced_and_parametrized_weights():
    # The forward reads parameters from the layers' dictionaries (fused_ops/nn.py);
    # a replaced Parameter and a parametrized weight (a property, no longer in
    # the dictionary) must be what it computes with, as the reference's layers do.
    torch.manual_seed(0)
    fused = fused_ops.nn.FlowODE(5, 3)
    x = torch.randn(4, 5)
    fused.velocity[4].bias = nn.Parameter(torch.randn(5))
    nn.utils.parametrize.register_parametrization(fused.velocity[2], "weight", Doubled())
    want = reference.FlowODE.forward(fused, x)
    torch.testing.assert_close(fused(x), want, **tol(torch.float32))
    nn.utils.parametrize.remove_parametrizations(fused.velocity[2], "weight", leave_parametrized=False)
    assert not torch.allclose(fused(x), want)


def test_from_reference_shares_parameters_and_user_copy(device):
    user = UserFlow(5, 3, hidden=13).to(device)
    fused = fused_ops.nn.FlowODE.from_reference(user)
    assert fused.velocity is user.velocity and fused.dt is user.dt and fused.num_steps == 3
    x = torch.randn(4, 5, device=device)
    torch.testing.assert_close(fused(x), user(x), **tol(torch.float32))
    with torch.no_grad():
        user.velocity[4].bias.add_(1.0)  # seen through the shared parameter
    torch.testing.assert_close(fused(x), user(x), **tol(torch.float32))


@pytest.mark.parametrize("kind", list(NON_MATCHING))
def test_from_reference_rejects_non_matching(kind):
    module = NON_MATCHING[kind](4, 3)
    assert not fused_ops.nn.FlowODE.matches(module)
    with pytest.raises(ValueError, match="flow-ODE reference module"):
        fused_ops.nn.FlowODE.from_reference(module)


def test_convert_model_tree(device):
    model = nn.Sequential(nn.Linear(5, 5), reference.FlowODE(5, 4), ReluFlow(5, 4)).to(device)
    x = torch.randn(3, 5, device=device)
    want = model(x)
    converted = fused_ops.nn.convert(model)
    assert isinstance(converted[1], fused_ops.nn.FlowODE)
    assert type(converted[2]) is ReluFlow  # not a reference module: left alone
    torch.testing.assert_close(converted(x), want, **tol(torch.float32))


def test_module_backward(device):
    ref_module = reference.FlowODE(4, 3).to(device)
    fused = fused_ops.nn.FlowODE.from_reference(ref_module)
    x = torch.randn(5, 4, device=device)
    g_fused = torch.autograd.grad(fused(x).square().sum(), list(fused.parameters()))
    g_ref = torch.autograd.grad(ref_module(x).square().sum(), list(ref_module.parameters()))
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
