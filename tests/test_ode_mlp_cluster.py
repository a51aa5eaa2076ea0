"""ode_mlp's ``cluster`` CUDA path (csrc/cuda/ode_mlp/cluster.cu): float32
batches of up to 32 rows in one thread-block cluster on sm_90; and its
``split`` path (csrc/cuda/ode_mlp/split.cu): the seed field (D = 64, widths
256, 256, 64, SiLU) with 4 or 2 blocks of a cluster per row.

Forced (``_paths.force("ode_mlp", "cluster")``) over many shapes -- B in {1,
3, 8, 17, 32}, D in {1, 2, 3, 64}, odd widths (3, 17, 33, 300), 1 to 8
Linear layers, every method and activation, all_states on and off,
sample_bias, decreasing grids, a single time -- against the CPU kernel in
float64 on the same float32 inputs, within a small multiple of the CPU
float32 run's own error.  Outputs are allocated from NaN-poisoned memory,
so an element the kernel fails to write fails the comparison.  Also: two
calls agree bitwise, the table chooses the path for small float32 batches
only, the seed flow agrees with the shared path, CUDA graph capture.

All of it needs a CUDA GPU of compute capability 9.0; elsewhere it is skipped.
"""

import math

import pytest
import torch

import fused_ops
from fused_ops.ops import _ode
from fused_test_utils import CUDA_AVAILABLE, poison_allocator

F32, F64 = torch.float32, torch.float64
METHODS = list(_ode.METHODS)
ACTS = list(_ode.ACTIVATIONS)
PARAMS = {"leaky_relu": 0.2, "elu": 0.7, "softplus": 2.0}
STAGES = {"euler": 1, "midpoint": 2, "heun2": 2, "heun3": 3, "rk4": 4}

pytestmark = pytest.mark.skipif(
    not CUDA_AVAILABLE or torch.cuda.get_device_capability() < (9, 0),
    reason="the cluster path needs a CUDA GPU of compute capability 9.0")

if CUDA_AVAILABLE:
    from fused_ops import _paths


def _program(B, D, widths, steps, method, act, sample_bias=True, down=False, all_states=True):
    """The op's arguments (float32, CPU) for a field D -> widths -> D: nn.Linear-scaled
    weights, a random time_bias per evaluation, optional sample_bias; the grid
    k / 2^m (exact in float32) or its reverse."""
    dims = [D, *widths, D]
    ws = [torch.randn(o, i, dtype=F64) / math.sqrt(i) for i, o in zip(dims[:-1], dims[1:])]
    bs = [torch.randn(o, dtype=F64) * 0.1 for o in dims[2:]]
    n_evals = steps * STAGES[method]
    tb = torch.randn(n_evals, dims[1], dtype=F64) * 0.3
    sb = torch.randn(B, dims[1], dtype=F64) * 0.3 if sample_bias else None
    m = max(steps - 1, 0).bit_length()
    t = torch.arange(steps + 1, dtype=F64) * 2.0**-m
    if down:
        t = t.flip(0)
    x0 = torch.randn(B, D, dtype=F64)
    f = lambda v: v.float()  # noqa: E731
    return [f(x0), f(t), [f(w) for w in ws], [f(b) for b in bs], f(tb), None if sb is None else f(sb),
            METHODS.index(method), ACTS.index(act), PARAMS.get(act, 0.0), all_states]


def _to(args, device=None, dtype=None):
    def conv(a):
        if isinstance(a, torch.Tensor):
            return a.to(device=device, dtype=dtype)
        if isinstance(a, list):
            return [conv(v) for v in a]
        return a
    return [conv(a) for a in args]


def _max_abs(t):
    return t.abs().max().item() if t.numel() else 0.0


def _sms():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _run_cluster(args, path="cluster"):
    """The forced path on poisoned memory; checks the path and bitwise repeatability."""
    cu = _to(args, device="cuda")
    B, D = args[0].shape
    S = args[1].shape[0] - 1
    poison_allocator("cuda", F32, [(S + 1) * B * D, B * D])
    with _paths.force("ode_mlp", path):
        got = torch.ops.fused_ops.ode_mlp(*cu)
        torch.cuda.synchronize()
        assert _paths.last("ode_mlp") == path
        again = torch.ops.fused_ops.ode_mlp(*cu)
    assert torch.equal(got, again), "two calls differ bitwise"
    return got.cpu()


def _check(args, factor=4.0, path="cluster"):
    got = _run_cluster(args, path)
    exact = torch.ops.fused_ops.ode_mlp(*_to(args, dtype=F64))
    ref32 = torch.ops.fused_ops.ode_mlp(*args)
    assert got.shape == ref32.shape
    assert torch.isfinite(got).all(), "non-finite (unwritten?) elements"
    err = _max_abs(got.double() - exact)
    err32 = _max_abs(ref32.double() - exact)
    scale = max(_max_abs(exact), 1.0)
    allowed = factor * err32 + 64 * 2.0**-23 * scale
    assert err <= allowed, f"{path} error {err:.3e} vs CPU float32's {err32:.3e} (allowed {allowed:.3e})"


# (B, D) over the batch and state sizes the path handles, each with a
# different field, method, activation and options (cycled), so that every
# width list, method, activation and option meets several (B, D).
_WIDTHS = ([], [33], [17, 300], [3], [64, 64], [33, 17, 300, 5], [8] * 7, [256, 256], [1, 20])
_SHAPES = []
for _i, (_B, _D) in enumerate((b, d) for b in (1, 3, 8, 17, 32) for d in (1, 2, 3, 64)):
    for _j in range(2):
        _k = 2 * _i + _j
        _SHAPES.append(dict(B=_B, D=_D, widths=_WIDTHS[_k % len(_WIDTHS)], steps=2 + _k % 3,
                            method=METHODS[_k % 5], act=ACTS[(3 * _k + _j) % 10], sample_bias=_k % 3 != 0,
                            down=_k % 4 == 1, all_states=_k % 2 == 0))


@pytest.mark.parametrize("spec", _SHAPES, ids=lambda s: "B{B}-D{D}-w{w}-{method}-{act}-S{steps}{sb}{down}{st}".format(
    w="x".join(map(str, s["widths"])) or "none", sb="-sb" if s["sample_bias"] else "",
    down="-down" if s["down"] else "", st="-all" if s["all_states"] else "-last", **{
        k: v for k, v in s.items() if k not in ("widths", "sample_bias", "down", "all_states")}))
def test_cluster_shapes(spec):
    s = dict(spec)
    _check(_program(s.pop("B"), s.pop("D"), s.pop("widths"), s.pop("steps"), s.pop("method"), s.pop("act"), **s))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("method", METHODS)
def test_cluster_methods_and_activations(method, act):
    _check(_program(5, 3, [33, 20], 3, method, act, sample_bias=True, down=method == "heun3"))


@pytest.mark.parametrize("all_states", [True, False])
@pytest.mark.parametrize("depth", range(1, 9))
def test_cluster_depths(depth, all_states):
    widths = [7, 33, 16, 5, 40, 9, 24][: depth - 1]
    _check(_program(9, 2, widths, 3, "rk4", "tanh", sample_bias=depth % 2 == 0, all_states=all_states))


@pytest.mark.parametrize("all_states", [True, False])
def test_cluster_single_time(all_states):
    """t_grid of one time: no step, the output is x0 (written by the kernel, not left poisoned)."""
    args = _program(3, 2, [8], 0, "midpoint", "silu", all_states=all_states)
    got = _run_cluster(args)
    assert torch.equal(got, args[0][None])


def _seed_flow(B, device, dtype=F32):
    """The seed flow: D = 64, three Linear layers of 256 (time as the last input column), SiLU, 32 Euler steps."""
    D, H = 64, 256
    dims = [(H, D + 1), (H, H), (D, H)]
    ws = [torch.randn(o, i, dtype=dtype, device=device) / math.sqrt(i) for o, i in dims]
    bs = [torch.randn(o, dtype=dtype, device=device) * 0.1 for o, _ in dims]
    x0 = torch.randn(B, D, dtype=dtype, device=device)
    return x0, torch.linspace(0, 1, 33, dtype=dtype, device=device), ws, bs


def test_cluster_seed_flow_matches_shared_and_float64():
    x0, t, ws, bs = _seed_flow(8, "cuda")
    run = lambda *a: fused_ops.odeint_mlp(*a, method="euler", activation="silu")  # noqa: E731
    with _paths.force("ode_mlp", "cluster"):
        got = run(x0, t, ws, bs)
        assert _paths.last("ode_mlp") == "cluster"
    with _paths.force("ode_mlp", "shared"):
        shared = run(x0, t, ws, bs)
    exact = run(*(_to([x0, t, ws, bs], device="cpu", dtype=F64)))
    err = _max_abs(got.cpu().double() - exact)
    err_shared = _max_abs(shared.cpu().double() - exact)
    assert err <= 4 * err_shared + 64 * 2.0**-23 * max(_max_abs(exact), 1.0), (err, err_shared)


@pytest.mark.parametrize("B,dtype", [(1, F32), (8, F32), (32, F32), (33, F32), (66, F32), (8, F64)])
def test_cluster_natural_choice(B, dtype):
    """The seed flow: split where 2B <= SMs (float32), else cluster up to 32 rows, else neither."""
    x0, t, ws, bs = _seed_flow(B, "cuda", dtype)
    fused_ops.odeint_mlp(x0, t, ws, bs, method="euler")
    took = _paths.last("ode_mlp")
    if dtype == F32 and 2 * B <= _sms():
        assert took == "split", (B, dtype, took)
    elif dtype == F32 and B <= 32:
        assert took == "cluster", (B, dtype, took)
    else:
        assert took not in ("split", "cluster"), (B, dtype, took)


def test_cluster_natural_choice_other_activation():
    """The seed shape with ReLU: split is SiLU only, cluster takes it."""
    x0, t, ws, bs = _seed_flow(8, "cuda")
    fused_ops.odeint_mlp(x0, t, ws, bs, method="euler", activation="relu")
    assert _paths.last("ode_mlp") == "cluster"


def test_cluster_path_too_large_is_refused():
    """Widths whose slices cannot fit shared memory: the forced path refuses (and names every path)."""
    args = _to(_program(4, 2, [3000, 3000], 1, "euler", "relu", sample_bias=False), device="cuda")
    with _paths.force("ode_mlp", "cluster"):
        with pytest.raises(RuntimeError, match="does not apply"):
            torch.ops.fused_ops.ode_mlp(*args)
    torch.ops.fused_ops.ode_mlp(*args)
    assert _paths.last("ode_mlp") != "cluster"


@pytest.mark.parametrize("path", ["cluster", "split"])
def test_cluster_cuda_graph_capture(path):
    if path == "split":
        args = _to(_program(8, 64, [256, 256], 4, "rk4", "silu"), device="cuda")
    else:
        args = _to(_program(8, 3, [40, 40], 4, "rk4", "gelu"), device="cuda")
    with _paths.force("ode_mlp", path):
        want = torch.ops.fused_ops.ode_mlp(*args)  # warm-up outside the capture: the occupancy query
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.fused_ops.ode_mlp(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


# ---------------------------------------------------------------------------
# The split path: the seed field only (D = 64, widths 256, 256, 64, SiLU).
# ---------------------------------------------------------------------------


def _seed_program(B, steps, method, **kw):
    return _program(B, 64, [256, 256], steps, method, "silu", **kw)


def _check_split(args):
    """The forced split path where 2B <= SMs; above, the forced path must refuse."""
    B = args[0].shape[0]
    if 2 * B > _sms():
        with _paths.force("ode_mlp", "split"):
            with pytest.raises(RuntimeError, match="does not apply"):
                torch.ops.fused_ops.ode_mlp(*_to(args, device="cuda"))
        return
    _check(args, path="split")


_SPLIT_SPECS = [dict(B=b, method=METHODS[i % 5], steps=1 + i % 3, sample_bias=i % 2 == 0, down=i % 3 == 1,
                     all_states=i % 2 == 1) for i, b in enumerate((1, 3, 8, 33, 66, 100))]


@pytest.mark.parametrize("spec", _SPLIT_SPECS, ids=lambda s: "B{}-{}-S{}{}{}{}".format(
    s["B"], s["method"], s["steps"], "-sb" if s["sample_bias"] else "", "-down" if s["down"] else "",
    "-all" if s["all_states"] else "-last"))
def test_split_batches(spec):
    """B = 1, 3, 8, 33 (4 blocks per row on 132 SMs), 66 (2 blocks), 100 (refused: 2B > SMs)."""
    s = dict(spec)
    _check_split(_seed_program(s.pop("B"), s.pop("steps"), s.pop("method"), **s))


@pytest.mark.parametrize("sample_bias", [True, False])
@pytest.mark.parametrize("all_states", [True, False])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("blocks", [4, 2])
def test_split_methods(blocks, method, all_states, sample_bias):
    """Every method, all_states on and off, with and without sample_bias, on both cluster sizes
    (the largest batch of each: 4 blocks per row at SMs // 4 rows, 2 at SMs // 2)."""
    B = _sms() // blocks
    _check_split(_seed_program(B, 3, method, sample_bias=sample_bias, down=method == "heun3",
                               all_states=all_states))


def test_split_single_time():
    """t_grid of one time: no step, the output is x0 (written by the kernel, not left poisoned)."""
    for all_states in (True, False):
        args = _seed_program(3, 0, "midpoint", all_states=all_states)
        assert torch.equal(_run_cluster(args, "split"), args[0][None])


@pytest.mark.parametrize("method", ["euler", "rk4"])
def test_split_misaligned_inputs(method):
    """Every tensor one float past a 16-byte boundary: the scalar weight loads and the
    4-byte time_bias copies."""
    args = _seed_program(5, 2, method)
    cu = []
    for a in args:  # moved to the GPU keeping the offset
        if isinstance(a, torch.Tensor):
            buf = torch.empty(a.numel() + 1, dtype=a.dtype, device="cuda")
            cu.append(buf[1:].view(a.shape).copy_(a))
        elif isinstance(a, list):
            cu.append([torch.empty(w.numel() + 1, dtype=w.dtype, device="cuda")[1:].view(w.shape).copy_(w)
                       for w in a])
        else:
            cu.append(a)
    assert cu[4].data_ptr() % 16 != 0 and cu[2][0].data_ptr() % 16 != 0
    with _paths.force("ode_mlp", "split"):
        got = torch.ops.fused_ops.ode_mlp(*cu)
        assert _paths.last("ode_mlp") == "split"
    with _paths.force("ode_mlp", "split"):
        aligned = torch.ops.fused_ops.ode_mlp(*_to(args, device="cuda"))
    assert torch.equal(got, aligned), "misaligned and aligned inputs differ"


def test_split_refuses_other_fields():
    for args in (_program(4, 64, [256, 256], 1, "euler", "relu"), _program(4, 64, [256, 128], 1, "euler", "silu"),
                 _program(4, 32, [256, 256], 1, "euler", "silu"), _program(4, 64, [256, 256, 256], 1, "euler", "silu"),
                 _to(_seed_program(4, 1, "euler"), dtype=F64)):
        with _paths.force("ode_mlp", "split"):
            with pytest.raises(RuntimeError, match="does not apply"):
                torch.ops.fused_ops.ode_mlp(*_to(args, device="cuda"))


def test_split_seed_sampler_matches_float64_euler():
    """The seed program through fused_ops.nn.ODESampler (time as the last input column, 32
    Euler steps, B = 8) against the Euler loop written out in float64 on the CPU."""
    import copy

    net = torch.nn.Sequential(torch.nn.Linear(65, 256), torch.nn.SiLU(), torch.nn.Linear(256, 256),
                              torch.nn.SiLU(), torch.nn.Linear(256, 64)).cuda()
    sampler = fused_ops.nn.ODESampler(net, method="euler", num_steps=32)
    x0 = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        got = sampler(x0)
        assert _paths.last("ode_mlp") == "split"

        def euler(model, y):
            for k in range(32):
                y = y + (1.0 / 32) * model(torch.cat([y, y.new_full((y.shape[0], 1), k / 32)], -1))
            return y
        exact = euler(copy.deepcopy(net).cpu().double(), x0.cpu().double())
        ref32 = euler(copy.deepcopy(net).cpu(), x0.cpu())
    err = _max_abs(got.cpu().double() - exact)
    err32 = _max_abs(ref32.double() - exact)
    assert err <= 4 * err32 + 64 * 2.0**-23 * max(_max_abs(exact), 1.0), (err, err32)
