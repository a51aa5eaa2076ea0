"""The contract every fused op keeps (DESIGN.md sections 2-4), written once
over the op table of op_cases.py and parametrised by op (and size, dtype,
device): agreement with the reference program, float32 accuracy against a
float64 run, every output written, layouts, empty batch, opcheck, meta,
torch.compile, determinism, bad inputs, CUDA device guard, streams, graphs
and agreement with the CPU, the CPU kernels' baseline ISA.

Autograd and the backward ops are test_contract_autograd.py's; what only one
op has (its numerics, its module, its training step) lives in its own file;
the CUDA kernel paths by name are test_cuda_paths.py's.  Every test draws
fresh inputs under its own seed (conftest.py); CUDA variants show up as
skipped on a machine without a GPU.
"""

import math

import re

import pytest
import torch

from contract_helpers import DTYPE_IDS, assert_close, assert_equal, check_meta, each_op, entries, params, sizes
from fused_test_utils import (
    DTYPES,
    check_error_names,
    outputs_per_thread_count,
    poison_allocator,
    requires_cuda,
    requires_two_gpus,
    run_with_baseline_isa,
    sync,
    tol,
)
from op_cases import F32, F64, as_tuple, max_abs


# Fields every op must fill: an empty one would silently drop a contract
# check for that op (the optional ones, e.g. empty_size, are op-specific).
REQUIRED = (
    "match_sizes", "accuracy", "poison_sizes", "layouts", "layout_sizes", "opcheck_sizes", "meta_size", "module",
    "compile_size", "determinism_sizes", "thread_size", "bad_size", "bad_inputs", "stream_sizes",
    "graph_sizes", "cuda_cpu_float64", "isa_sizes", "paths", "natural", "refused", "path_names",
)
# ... and, for a differentiable op, the autograd contract's and its backward op's.
REQUIRED_AUTOGRAD = (
    "compile_loss", "gradcheck_sizes", "gradcheck_inputs", "gradcheck_alone_size",
    "grad64_sizes", "grad32_sizes", "grad32_check", "bwd", "bwd_args", "bwd_grad_names", "bwd_opcheck_sizes",
    "bwd_meta_size", "bwd_determinism_sizes", "bwd_bad_size", "bwd_bad", "bwd_stream_size", "bwd_graph_size",
    "bwd_cuda_cpu_sizes", "bwd_paths", "bwd_natural", "bwd_path_names",
)


@pytest.mark.parametrize("case", each_op())
def test_op_table_entry_is_complete(case):
    required = REQUIRED + (REQUIRED_AUTOGRAD if case.differentiable else ())
    if len(case.path_names) == 1:  # one path, taken for anything: nothing to refuse
        required = tuple(f for f in required if f != "refused")
    missing = [f for f in required if not getattr(case, f)]
    assert not missing, f"{case.name}: op_cases leaves {missing} empty"
    assert len(case.out_shapes(case.meta_size)) == len(case.out_names)
    assert set(b.arg for b in case.bad_inputs) >= set(case.arg_names), "a bad-input case per argument"


# ---------------------------------------------------------------------------
# Agreement with the reference; float32 accuracy against float64
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case,size", sizes("match_sizes"))
def test_matches_reference(case, size, dtype, device):
    reason = case.match_skip(size, dtype, device)
    if reason:
        pytest.skip(reason)
    args = case.inputs(size, dtype=dtype, device=device)
    want = case.ref(args, size)
    got = case.fused(args, size)
    check_meta(case, got, size, dtype, device)
    if case.match_check is not None:
        case.match_check(case, got, want, args, dtype)
    else:
        assert_close(case.out_names, got, want, **tol(dtype))
    if case.single_run_check is not None:
        case.single_run_check(case, got, want, args, dtype)


@pytest.mark.parametrize("case,size,atol", params(lambda c: [(c.size_id(s), s, t) for s, t in c.float64_tight]))
def test_float64_is_float64(case, size, atol, device):
    # A float32 computation in disguise would be ~1e-7 off.
    args = case.inputs(size, dtype=F64, device=device)
    assert_close(case.out_names, case.fused(args, size), case.ref(args, size), atol=atol, rtol=atol)


@pytest.mark.parametrize("case,acc", params(lambda c: [(c.size_id(a.size), a) for a in c.accuracy]))
def test_float32_accuracy_vs_float64(case, acc, device):
    n = len(case.out_names)
    err_fused, err_ref, scale = [0.0] * n, [0.0] * n, [0.0] * n
    for _ in range(acc.trials):
        args = case.inputs(acc.size, device=device, **acc.make_kw)
        exact = case.ref([a.double() for a in args], acc.size)
        ref32 = case.ref(args, acc.size)
        got = case.fused(args, acc.size)
        for i in range(n):
            err_ref[i] += max_abs(ref32[i].double() - exact[i])
            err_fused[i] += max_abs(got[i].double() - exact[i])
            scale[i] += max(max_abs(exact[i]), acc.scale_min)
    for i, name in enumerate(case.out_names):
        floor = acc.floor_ulps * 2.0**-23 * scale[i]
        allowed = (acc.bound * err_ref[i] + floor if acc.combine == "sum"
                   else max(acc.bound * err_ref[i], floor))
        assert err_fused[i] <= allowed, (
            f"{name}: fused float32 error {err_fused[i]:.3e} (summed over {acc.trials} runs) is worse than "
            f"{acc.bound}x the float32 reference's {err_ref[i]:.3e} (floor {floor:.1e}, {acc.combine})"
        )


# ---------------------------------------------------------------------------
# Every output element is written; layouts; empty batch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case,size", sizes("poison_sizes"))
def test_outputs_fully_written(case, size, dtype, device):
    args = case.inputs(size, dtype=dtype, device=device)
    want = case.ref(args, size)
    results = []
    for _ in range(2):
        poison_allocator(device, dtype, case.poison_numels(size))
        out = case.fused(args, size)
        sync(device)
        results.append(out)
        for name, t in zip(case.out_names, out):
            assert not torch.isnan(t).any(), f"{name} contains NaN from the poisoned allocator"
        if case.invariants is not None:
            case.invariants(out, args, dtype)
        assert_close(case.out_names, out, want, **tol(dtype))
    assert_equal(case.out_names, results[0], results[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "case,layout,size",
    params(lambda c: [(f"{name}-{c.size_id(s)}", name, s) for name in c.layouts for s in c.layout_sizes]),
)
def test_non_contiguous_inputs(case, layout, size, dtype, device):
    args = case.inputs(size, dtype=dtype, device=device)
    transform, kind = case.layouts[layout]
    views = transform(args)
    for name, v, a in zip(case.arg_names, views, args):
        assert torch.equal(v, a), name  # the same values
    if kind == "misaligned":
        assert all(v.is_contiguous() and v.data_ptr() % 16 != 0 for v in views)
    else:
        assert any(not v.is_contiguous() for v in views)
    got = case.fused(views, size)
    for t in got:
        assert t.is_contiguous()
    plain = case.fused(args, size)
    if layout in case.cpu_rounding_layouts and torch.device(device).type == "cpu":
        assert_close(case.out_names, got, plain, **tol(dtype))
    else:
        # The same values in other memory give bitwise the same result.
        assert_equal(case.out_names, got, plain)
    assert_close(case.out_names, got, case.ref(args, size), **tol(dtype))


@pytest.mark.parametrize("case", each_op("expanded"))
def test_expanded_inputs(case, device):
    # Zero strides (broadcast views), as a user's expand() hands them over.
    size, args = case.expanded(device)
    assert any(0 in a.stride() for a in args)
    got = case.fused(args, size)
    plain = case.fused([a.contiguous() for a in args], size)
    if case.expanded_bitwise:
        assert_equal(case.out_names, got, plain)
    else:
        assert_close(case.out_names, got, plain, **tol(F32))
    assert_close(case.out_names, got, case.ref(args, size), **tol(F32))


@pytest.mark.parametrize("case", each_op("empty_size"))
def test_empty_batch(case, device):
    size = case.empty_size
    out = case.fused(case.inputs(size, device=device), size)
    check_meta(case, out, size, F32, device)


# ---------------------------------------------------------------------------
# opcheck (schema, fake tensor, autograd registration, AOT dispatch), meta
# ---------------------------------------------------------------------------

GRAD_MODES = ["none", "all", "first", "rest"]


@pytest.mark.parametrize("grad", GRAD_MODES, ids=[f"requires_grad-{g}" for g in GRAD_MODES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case,size", sizes("opcheck_sizes"))
def test_opcheck(case, size, dtype, grad, device):
    args = case.inputs(size, dtype=dtype, device=device)
    for i, a in enumerate(args):
        if grad == "all" or (grad == "first" and i == 0) or (grad == "rest" and i > 0):
            a.requires_grad_()
    result = torch.library.opcheck(case.op, case.op_args(args, size))
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("case", each_op())
def test_meta_tensors(case):
    size = case.meta_size
    out = case.fused(case.inputs(size, device="meta"), size)
    check_meta(case, out, size, F32, "meta")


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", each_op("module"))
def test_compile_fullgraph_module(case, device):
    torch._dynamo.reset()
    module, ref, inputs = case.module(device)
    compiled = torch.compile(module, fullgraph=True)  # raises on a graph break
    got = as_tuple(compiled(*inputs))
    assert_equal(case.out_names, got, as_tuple(module(*inputs)))
    assert_close(case.out_names, got, as_tuple(ref(*inputs)), **tol(F32))


@pytest.mark.parametrize("case", each_op("compile_loss"))
def test_compile_backward(case, device):
    torch._dynamo.reset()
    size = case.compile_size
    args = case.inputs(size, device=device, requires_grad=True)

    def loss(*a):
        return case.compile_loss(case.call(case.packet, a, size))

    eager = torch.autograd.grad(loss(*args), args)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*args), args)
    for name, a, b in zip(case.arg_names, compiled, eager):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"grad {n}: {m}", **case.compile_tol)


# ---------------------------------------------------------------------------
# Bitwise determinism
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case,size", sizes("determinism_sizes"))
def test_deterministic_repeated_calls(case, size, dtype, device):
    args = case.inputs(size, dtype=dtype, device=device)
    first = case.fused(args, size)
    for _ in range(3):
        assert_equal(case.out_names, case.fused(args, size), first)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", each_op())
def test_deterministic_across_thread_counts(case, dtype):
    size = case.thread_size
    args = case.inputs(size, dtype=dtype)
    results = outputs_per_thread_count(lambda: case.fused(args, size), (1, 2, 3, 7))
    for out in results.values():
        assert_equal(case.out_names, out, results[1])


# ---------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case,entry,bad",
    params(lambda c: [(f"{b.id}-{eid}", fn, b) for b in c.bad_inputs for eid, fn in entries(c)]),
)
def test_bad_inputs(case, entry, bad, device):
    if bad.cpu_only and device != "cpu":
        pytest.skip("a check of the values that only the CPU kernel makes")
    size = case.bad_size
    args = bad.modify(case.inputs(size, device=device))
    with pytest.raises((RuntimeError, ValueError)) as excinfo:
        case.call(entry, args, size, bad.scalars)
        sync(device)
    check_error_names(excinfo, bad.arg, bad.expected)


def _meta(args):
    return [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]


def _error_message(fn):
    with pytest.raises((RuntimeError, ValueError)) as excinfo:
        fn()
    return str(excinfo.value)


@pytest.mark.parametrize(
    "case,entry,bad",
    # cpu_only rows check values, which meta tensors do not have.
    params(lambda c: [(f"{b.id}-{eid}", fn, b) for b in c.bad_inputs if not b.cpu_only for eid, fn in entries(c)]),
)
def test_bad_inputs_meta(case, entry, bad):
    # The fakes (fused_ops/ops/_checks.py) state the C++ checks again, for
    # meta and fake tensors: every bad-input row must fail on meta tensors
    # with exactly the message the CPU kernel's checks give, so that the two
    # sets of rules cannot drift apart.
    size = case.bad_size
    args = bad.modify(case.inputs(size))
    cpu = _error_message(lambda: case.call(entry, args, size, bad.scalars))
    meta = _error_message(lambda: case.call(entry, _meta(args), size, bad.scalars))
    assert meta == cpu


@pytest.mark.parametrize(
    "case,entry,arg",
    params(lambda c: [(f"{n}-{eid}", fn, i) for i, n in enumerate(c.arg_names) for eid, fn in entries(c)]),
)
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "requires_grad"])
def test_none_argument(case, entry, arg, requires_grad, device):
    # None for a tensor: the error names the argument and says what was
    # expected (not an empty tensor's "got shape [0]", nor an AttributeError
    # or a C shim failure), on the real device and on meta alike.
    size = case.bad_size
    if case.arg_names[arg] in case.optional_args and entry is not case.packet:
        pytest.skip("the Python function takes None here")
    args = case.inputs(size, device=device, requires_grad=requires_grad)
    args[arg] = None
    with pytest.raises(RuntimeError) as excinfo:
        case.call(entry, args, size)
        sync(device)
    name = case.arg_names[arg]
    check_error_names(excinfo, name, r"must be a \d-D tensor .*, got None$")
    with pytest.raises(RuntimeError, match=r"got None$"):
        case.call(entry, _meta(args), size)


@pytest.mark.parametrize(
    "case,entry,arg",
    params(lambda c: [(f"{n}-{eid}", fn, i) for i, n in enumerate(c.arg_names) for eid, fn in entries(c)]),
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_meta_among_real_tensors(case, entry, arg, dtype, device):
    # One input on meta, the others real: the dispatcher runs the fake (the
    # Meta kernel) for such a call, which must refuse it by name rather than
    # return uninitialised memory on the first input's device (or, for a
    # meta first input, meta outputs).  When the first input is the meta one
    # it sets the expected device, and the second is named.
    size = case.bad_size
    args = case.inputs(size, dtype=dtype, device=device)
    args[arg] = args[arg].to("meta")
    with pytest.raises(RuntimeError) as excinfo:
        case.call(entry, args, size)
        sync(device)
    check_error_names(excinfo, case.arg_names[arg if arg else 1], r"must be on the same device as .*\bmeta\b")


@pytest.mark.parametrize("case", each_op())
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_meta_shapes_checked(case, dtype):
    # All inputs on meta (shapes only, as under the fake): a valid call gives
    # outputs of the right shapes; a wrong shape or an integer dtype raises
    # as on the CPU (every row: test_bad_inputs_meta).
    size = case.meta_size
    out = case.fused(case.inputs(size, dtype=dtype, device="meta"), size)
    check_meta(case, out, size, dtype, "meta")
    args = [a.long() for a in case.inputs(size, dtype=dtype, device="meta")]
    with pytest.raises(RuntimeError, match=rf"{case.arg_names[0]} must be float32 or float64, got int64"):
        case.fused(args, size)
    args = case.inputs(size, dtype=dtype, device="meta")
    args[-1] = args[-1][:-1]
    with pytest.raises(RuntimeError, match=rf"{re.escape(case.arg_names[-1])}\.shape\[0\] must be"):
        case.fused(args, size)


@requires_cuda
@pytest.mark.parametrize(
    "case,entry,cpu_arg",
    params(lambda c: [(f"{n}-{eid}", fn, i) for i, n in enumerate(c.arg_names) for eid, fn in entries(c)]),
)
def test_cpu_cuda_mix(case, entry, cpu_arg):
    size = case.bad_size
    args = case.inputs(size, device="cuda")
    args[cpu_arg] = args[cpu_arg].cpu()
    with pytest.raises((RuntimeError, ValueError)) as excinfo:
        case.call(entry, args, size)
        torch.cuda.synchronize()
    # The message names a tensor on the wrong device: the CPU one, or (when
    # the first argument is the CPU one and so sets the expected device) the
    # second.
    check_error_names(excinfo, case.arg_names[cpu_arg if cpu_arg else 1], r"device|cuda|cpu")


@requires_two_gpus
@pytest.mark.parametrize("case", each_op())
def test_two_cuda_devices_mix(case):
    size = case.bad_size
    args = case.inputs(size, device="cuda:0")
    moved = min(2, len(args) - 1)
    args[moved] = args[moved].to("cuda:1")
    with pytest.raises((RuntimeError, ValueError)) as excinfo:
        case.fused(args, size)
        torch.cuda.synchronize()
    check_error_names(excinfo, case.arg_names[moved], r"device|cuda")


# ---------------------------------------------------------------------------
# CUDA: device guard, current stream, graph capture, CPU agreement
# ---------------------------------------------------------------------------


@requires_two_gpus
@pytest.mark.parametrize("case", each_op())
def test_cuda_device_guard(case):
    size = case.stream_sizes[0]
    args = case.inputs(size, device="cuda:1")
    with torch.cuda.device(0):
        out = case.fused(args, size)
    assert all(t.device == torch.device("cuda:1") for t in out)
    torch.cuda.synchronize(1)
    assert_close(case.out_names, out, case.ref(args, size), **tol(F32))


@requires_cuda
@pytest.mark.parametrize("case,size", sizes("stream_sizes"))
def test_cuda_uses_current_stream(case, size):
    src = case.inputs(size, device="cuda")
    want = case.fused(src, size)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # The caching allocator pools blocks per stream: poison the side
        # stream's pool with NaN and wait for it.  Then delay the side stream
        # and produce the input on it: a kernel that ignored the current
        # stream would run before the copy lands and read the NaN-poisoned,
        # not yet written buffer.
        poison_allocator("cuda", F32, [src[0].numel(), *(math.prod(s) for s in case.out_shapes(size))])
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        first = src[0] * 1.0
        out = case.fused([first, *src[1:]], size)
    torch.cuda.synchronize()
    assert_equal(case.out_names, out, want)


@requires_cuda
@pytest.mark.parametrize("case,size", sizes("graph_sizes"))
def test_cuda_graph_capture(case, size):
    # No host synchronisation inside the op: it can be captured in a CUDA
    # graph (what torch.compile mode="reduce-overhead" does) and replayed.
    args = case.inputs(size, device="cuda")
    static = args[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        case.fused([static, *args[1:]], size)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = case.fused([static, *args[1:]], size)
    fresh = case.fresh_first(static)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(case.out_names, out, case.fused([fresh, *args[1:]], size))


@requires_cuda
@pytest.mark.parametrize(
    "case,size,rtol,atol", params(lambda c: [(c.size_id(s), s, r, a) for s, r, a in c.cuda_cpu_float64])
)
def test_cuda_matches_cpu_float64(case, size, rtol, atol):
    args = case.inputs(size, dtype=F64)
    got = case.fused([a.cuda() for a in args], size)
    assert_close(case.out_names, [g.cpu() for g in got], case.fused(args, size), rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", each_op())
def test_cpu_baseline_isa_matches_reference(case, tmp_path):
    """The CPU kernels have an SSE2 baseline and an AVX2 build chosen at run
    time; ATEN_CPU_CAPABILITY=default forces the baseline, which must be
    right too."""
    run_with_baseline_isa(
        tmp_path,
        "from op_cases import CASES\n"
        f"case = CASES[{case.name!r}]\n"
        f"for size in {list(case.isa_sizes)!r}:\n"
        "    for dt in (torch.float32, torch.float64):\n"
        "        args = case.inputs(size, dtype=dt)\n"
        f"        {case.isa_prepare or 'pass'}\n"
        "        tol = 1e-4 if dt == torch.float32 else 1e-10\n"
        "        for g, w in zip(case.fused(args, size), case.ref(args, size)):\n"
        "            torch.testing.assert_close(g, w, atol=tol, rtol=tol)",
    )


@pytest.mark.parametrize("case", each_op())
def test_export_reports_bad_shape_at_trace_time(case):
    # torch.export traces with fake tensors: a shape mistake is reported
    # while tracing, with the CPU kernel's message, not first at run time.
    size = case.bad_size
    bad = next(b for b in case.bad_inputs if b.scalars is None and "shape[" in _error_message(
        lambda b=b: case.call(case.packet, b.modify(case.inputs(size)), size)))
    args = bad.modify(case.inputs(size))
    cpu = _error_message(lambda: case.call(case.packet, args, size))

    class Call(torch.nn.Module):
        def forward(self, *a):
            return case.packet(*case.op_args(a, size))

    with pytest.raises(Exception) as excinfo:
        torch.export.export(Call(), tuple(args))
    assert cpu in str(excinfo.value)
