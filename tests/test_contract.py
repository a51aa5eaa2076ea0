"""The contract every fused op keeps (DESIGN.md sections 2-4), written once
over the op table of op_cases.py and parametrised by op (and size, dtype,
device): agreement with the reference program, float32 accuracy against a
float64 run, every output written, layouts, opcheck, meta, autograd,
torch.compile, determinism, bad inputs, CUDA streams and graphs, and the
backward ops' own contract.

What only one op has (its numerics, its module, its training step) lives in
its own file; the CUDA kernel paths by name are test_cuda_paths.py's.
Every test draws fresh inputs under its own seed (conftest.py); CUDA
variants show up as skipped on a machine without a GPU.
"""

import math

import pytest
import torch

from fused_test_utils import (
    DEVICE_PARAMS,
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
from op_cases import CASES, F32, F64, all_subsets, as_tuple, max_abs, subset_id

DTYPE_IDS = ["f32", "f64"]


def params(fn, *, ops=None):
    """pytest.params ``(case, *rest)`` over the table: ``fn(case)`` yields
    ``(id, *rest)`` tuples for one op."""
    out = []
    for case in CASES.values():
        if ops is not None and case.name not in ops:
            continue
        for item in fn(case):
            ident, *rest = item
            out.append(pytest.param(case, *rest, id=f"{case.name}-{ident}" if ident else case.name))
    return out


def each_op(attr=None):
    """One param per op (that has a truthy ``attr``)."""
    return params(lambda c: [("",)] if attr is None or getattr(c, attr) else [])


def sizes(attr):
    return params(lambda c: [(c.size_id(s), s) for s in getattr(c, attr)])


def assert_equal(names, got, want):
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.equal(g, w), f"{name} differs bitwise: max |diff| = {(g - w).abs().max().item()}"


def assert_close(names, got, want, **kw):
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, msg=lambda m, n=name: f"{n}: {m}", **kw)


def check_meta(case, out, size, dtype, device):
    shapes = case.out_shapes(size)
    assert len(out) == len(shapes)
    for name, t, shape in zip(case.out_names, out, shapes):
        assert tuple(t.shape) == tuple(shape), (name, t.shape, shape)
        assert t.dtype == dtype and t.is_contiguous(), name
        assert t.device.type == torch.device(device).type, name


def entries(case):
    return [("torch.ops", case.packet), ("wrapper", case.fn)]


# Fields every op must fill: an empty one would silently drop a contract
# check for that op (the optional ones, e.g. empty_size, are op-specific).
REQUIRED = (
    "match_sizes", "accuracy", "poison_sizes", "layouts", "layout_sizes", "opcheck_sizes", "meta_size", "module",
    "compile_size", "compile_loss", "determinism_sizes", "thread_size", "bad_size", "bad_inputs", "stream_sizes",
    "graph_sizes", "cuda_cpu_float64", "isa_sizes", "gradcheck_sizes", "gradcheck_inputs", "gradcheck_alone_size",
    "grad64_sizes", "grad32_sizes", "grad32_check", "bwd", "bwd_args", "bwd_grad_names", "bwd_opcheck_sizes",
    "bwd_meta_size", "bwd_determinism_sizes", "bwd_bad_size", "bwd_bad", "bwd_stream_size", "bwd_graph_size",
    "bwd_cuda_cpu_sizes", "paths", "natural", "refused", "path_names", "bwd_paths", "bwd_natural", "bwd_path_names",
)


@pytest.mark.parametrize("case", each_op())
def test_op_table_entry_is_complete(case):
    missing = [f for f in REQUIRED if not getattr(case, f)]
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
    result = torch.library.opcheck(case.op, (*args, *case.scalars(size)))
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("case", each_op())
def test_meta_tensors(case):
    size = case.meta_size
    out = case.fused(case.inputs(size, device="meta"), size)
    check_meta(case, out, size, F32, "meta")


# ---------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------


def gradcheck_params():
    def rows(c):
        for size, fast in c.gradcheck_sizes:
            for sub in all_subsets(len(c.out_names)):
                yield (f"{c.size_id(size)}-{subset_id(c.out_names, sub)}", size, fast, sub)

    return params(rows)


@pytest.mark.parametrize("case,size,fast,outputs", gradcheck_params())
def test_gradcheck(case, size, fast, outputs, device):
    # Every input requires grad: the full Jacobian of the selected outputs
    # with respect to every input, and (check_undefined_grad) the backward
    # with undefined upstream gradients for the outputs left out.
    args = case.gradcheck_inputs(case, size, device)

    def f(*a):
        out = case.fused(list(a), size)
        return tuple(out[i] for i in outputs)

    assert torch.autograd.gradcheck(f, tuple(args), fast_mode=fast, **case.gradcheck_tol)


@pytest.mark.parametrize("case,which", params(lambda c: [(n, i) for i, n in enumerate(c.arg_names)]))
def test_gradcheck_each_input_alone(case, which, device):
    # Only one input requires grad (autograd asks for that gradient only).
    size = case.gradcheck_alone_size
    args = [a.detach() for a in case.gradcheck_inputs(case, size, device)]
    args[which].requires_grad_()

    def f(t):
        a = list(args)
        a[which] = t
        return case.fused(a, size)

    assert torch.autograd.gradcheck(f, (args[which],), **case.gradcheck_tol)


@pytest.mark.parametrize("case", each_op())
def test_gradcheck_nonlinear_loss(case, device):
    # A scalar loss that is nonlinear in the outputs: the upstream gradients
    # depend on the outputs' values.
    size = case.gradcheck_sizes[0][0]
    args = case.gradcheck_inputs(case, size, device)
    with torch.no_grad():
        c = [torch.randn_like(o) for o in case.fused(args, size)]

    def loss(*a):
        out = case.fused(list(a), size)
        return sum((o * ci).sum() + 0.3 * case.nonlinear(o).sum() for o, ci in zip(out, c))

    assert torch.autograd.gradcheck(loss, tuple(args), **case.gradcheck_tol)


def grads_of(case, fn, args, size, upstream, subset):
    outs = case.call(fn, args, size)
    return torch.autograd.grad([outs[i] for i in subset], args, [upstream[i] for i in subset],
                               allow_unused=True, materialize_grads=True)


def grad64_params():
    def rows(c):
        for size, subsets, kw in c.grad64_sizes:
            for sub in subsets:
                yield (f"{c.size_id(size)}-{subset_id(c.out_names, sub)}", size, sub, kw)

    return params(rows)


@pytest.mark.parametrize("case,size,outputs,make_kw", grad64_params())
def test_grad_float64_vs_reference(case, size, outputs, make_kw, device):
    # Losses that use only some outputs (the others get no gradient).
    args = case.inputs(size, dtype=F64, device=device, requires_grad=True, **make_kw)
    with torch.no_grad():
        upstream = [torch.randn_like(o) for o in case.fused(args, size)]
    got = grads_of(case, case.fn, args, size, upstream, outputs)
    want = grads_of(case, case.reference, args, size, upstream, outputs)
    rtol, atol = case.grad64_tol
    for name, a, b in zip(case.arg_names, got, want):
        finite = b[torch.isfinite(b)]
        scale = max(max_abs(finite), 1.0)
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * scale, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize(
    "case,size,outputs",
    params(lambda c: [(f"{c.size_id(s)}-{subset_id(c.out_names, sub)}", s, sub) for s, sub in c.grad32_sizes]),
)
def test_grad_float32_vs_reference(case, size, outputs, device):
    # float32 gradients against the float32 reference's autograd and a
    # float64 run of it; the criterion is the op's (op_cases: grad32_check).
    if case.grad32_inputs is not None:
        args = case.grad32_inputs(case, size, device)
    else:
        args = case.inputs(size, device=device, requires_grad=True)
    with torch.no_grad():
        outs = case.fused(args, size)
    upstream = (case.grad32_upstream(outs, size) if case.grad32_upstream is not None
                else [torch.randn_like(o) for o in outs])
    got = grads_of(case, case.fn, args, size, upstream, outputs)
    ref32 = grads_of(case, case.reference, args, size, upstream, outputs)
    args64 = [a.detach().double().requires_grad_() for a in args]
    exact = grads_of(case, case.reference, args64, size, [u.double() for u in upstream], outputs)
    case.grad32_check(case, got, ref32, exact, dict(subset=outputs, upstream=upstream))


@pytest.mark.parametrize("case", each_op())
def test_first_order_grad_builds_no_graph(case, device):
    # create_graph=False: the gradients do not require grad themselves.
    size = case.gradcheck_alone_size
    args = case.inputs(size, device=device, requires_grad=True)
    grads = torch.autograd.grad(sum(o.sum() for o in case.fused(args, size)), args)
    for name, g in zip(case.arg_names, grads):
        assert g.grad_fn is None and not g.requires_grad, name


@pytest.mark.parametrize("case", each_op())
def test_double_backward_raises(case, device):
    # A clear error, never a wrong answer: through autograd.grad(create_graph)
    # and through gradgradcheck.
    size = case.gradcheck_alone_size
    args = case.inputs(size, dtype=F64, device=device, requires_grad=True)
    loss = sum(o.sum() for o in case.fused(args, size))
    grads = torch.autograd.grad(loss, args, create_graph=True)
    with pytest.raises(RuntimeError, match=case.double_backward_match):
        torch.autograd.grad(sum(g.square().sum() for g in grads), args, allow_unused=True)
    with pytest.raises(RuntimeError, match=case.double_backward_match):
        torch.autograd.gradgradcheck(lambda *a: case.fused(list(a), size)[-1], tuple(args))


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
        return case.compile_loss(as_tuple(case.packet(*a, *case.scalars(size))))

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
    size = case.bad_size
    args = bad.modify(case.inputs(size, device=device))
    with pytest.raises((RuntimeError, ValueError)) as excinfo:
        case.call(entry, args, size, bad.scalars)
        sync(device)
    check_error_names(excinfo, bad.arg, bad.expected)


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
    args[2] = args[2].to("cuda:1")
    with pytest.raises((RuntimeError, ValueError)) as excinfo:
        case.fused(args, size)
        torch.cuda.synchronize()
    check_error_names(excinfo, case.arg_names[2], r"device|cuda")


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


# ---------------------------------------------------------------------------
# The backward ops (torch.ops.fused_ops.<op>_backward), called directly
# ---------------------------------------------------------------------------


def bwd_grads_id(c, grads):
    return "+".join(n for n, g in zip(c.bwd_grad_names, grads) if g) or "none"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "case,size,grads",
    params(lambda c: [(f"{c.size_id(s)}-{bwd_grads_id(c, g)}", s, g) for s in c.bwd_opcheck_sizes
                      for g in c.bwd_opcheck_grads]),
)
def test_opcheck_backward_op(case, size, grads, dtype, device):
    a = case.bwd_args(case, size, dtype, device, grads)
    result = torch.library.opcheck(case.bwd, a)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("case", each_op())
def test_backward_op_meta_shapes(case):
    # One gradient per input, of its shape, contiguous.
    size = case.bwd_meta_size
    a = case.bwd_args(case, size, F32, "cpu")
    inputs = case.inputs(size, device="meta")
    a = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in a)
    out = case.bwd_call(a)
    assert [tuple(t.shape) for t in out] == [tuple(t.shape) for t in inputs]
    assert all(t.device.type == "meta" and t.is_contiguous() for t in out)


def _upstream_expanded(t):
    return t.reshape(-1)[:1].reshape(()).expand(t.shape) if t.dim() else t


def bwd_layout_params():
    def rows(c):
        size = c.bwd_determinism_sizes[-1]
        yield ("upstream_expanded", size, "upstream_expanded")
        if any(len(s) == 2 for s in c.out_shapes(size)):  # a 2-D upstream gradient to transpose
            yield ("upstream_transposed", size, "upstream_transposed")
        yield ("inputs_transposed", size, "inputs_transposed")

    return params(rows)


@pytest.mark.parametrize("case,size,layout", bwd_layout_params())
def test_backward_op_layouts(case, size, layout, device):
    # Upstream gradients as autograd often hands them over (expanded from
    # out.sum(), stride 0; transposed) and transposed inputs give bitwise the
    # result of the same values in contiguous memory.
    a = list(case.bwd_args(case, size, F32, device))
    nu = len(case.bwd_grad_names)
    for i, t in enumerate(a):
        if not isinstance(t, torch.Tensor):
            continue
        if i < nu and layout == "upstream_expanded":
            a[i] = _upstream_expanded(t)
        elif i < nu and layout == "upstream_transposed":
            a[i] = _transposed_2d(t)
        elif i >= nu and layout == "inputs_transposed":
            a[i] = _transposed_2d(t)
    assert any(isinstance(t, torch.Tensor) and not t.is_contiguous() for t in a)
    want = case.bwd_call(tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in a))
    got = case.bwd_call(tuple(a))
    for name, g, w in zip(case.arg_names, got, want):
        assert g.is_contiguous() and torch.equal(g, w), name


def _transposed_2d(t):
    return t.t().contiguous().t() if t.dim() == 2 else t


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case,size", sizes("bwd_determinism_sizes"))
def test_backward_deterministic(case, size, dtype, device):
    a = case.bwd_args(case, size, dtype, device)
    first = case.bwd_call(a)
    for _ in range(2):
        again = case.bwd_call(a)
        sync(device)
        for name, f, g in zip(case.arg_names, first, again):
            assert torch.equal(f, g), f"{name} differs bitwise between calls"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", each_op("bwd_thread_size"))
def test_backward_deterministic_across_thread_counts(case, dtype):
    a = case.bwd_args(case, case.bwd_thread_size, dtype, "cpu")
    results = outputs_per_thread_count(lambda: case.bwd_call(a), (1, 2, 3, 7))
    for out in results.values():
        for name, f, g in zip(case.arg_names, out, results[1]):
            assert torch.equal(f, g), name


@pytest.mark.parametrize("case,bad", params(lambda c: [(b.id, b) for b in c.bwd_bad]))
def test_backward_op_bad_inputs(case, bad, device):
    if bad.cuda_only and torch.device(device).type != "cuda":
        pytest.skip("needs inputs on a CUDA device")
    a = bad.modify(case.bwd_args(case, case.bwd_bad_size, F32, device))
    with pytest.raises(RuntimeError, match=bad.match):
        case.bwd_call(a)
        sync(device)


@pytest.mark.parametrize("case", each_op("bwd_linearity_size"))
def test_backward_op_linear_in_upstream(case, device):
    # The backward is linear in the upstream gradients: the gradients for a
    # combination equal the sum of the gradients for each one; None means
    # zero; all None gives zero gradients.
    nu = len(case.bwd_grad_names)
    a = case.bwd_args(case, case.bwd_linearity_size, F64, device)
    ups, rest = a[:nu], a[nu:]
    total = case.bwd_call(a)
    parts = [case.bwd_call((*(u if j == i else None for j, u in enumerate(ups)), *rest)) for i in range(nu)]
    zeros = [case.bwd_call((*(u if j == i else torch.zeros_like(u) for j, u in enumerate(ups)), *rest))
             for i in range(nu)]
    for i in range(nu):
        assert_close(case.arg_names, parts[i], zeros[i], rtol=1e-12, atol=1e-12)
    for name, t, *p in zip(case.arg_names, total, *parts):
        torch.testing.assert_close(t, sum(p), rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    for name, z in zip(case.arg_names, case.bwd_call((*(None,) * nu, *rest))):
        assert torch.equal(z, torch.zeros_like(z)), name


@pytest.mark.parametrize("case", each_op("bwd_empty_size"))
def test_backward_op_empty_batch(case, device):
    size = case.bwd_empty_size
    a = case.bwd_args(case, size, F32, device)
    inputs = a[len(case.bwd_grad_names):]
    out = case.bwd_call(a)
    for name, o, t in zip(case.arg_names, out, inputs):
        assert o.shape == t.shape, name
        assert torch.equal(o, torch.zeros_like(o)), name


@requires_cuda
@pytest.mark.parametrize("case", each_op())
def test_backward_cuda_uses_current_stream(case):
    a = list(case.bwd_args(case, case.bwd_stream_size, F32, "cuda"))
    i = case.bwd_upstream_index
    want = case.bwd_call(tuple(a))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Poison the side stream's pool, delay the stream, then produce an
        # upstream gradient on it: a kernel that ignored the current stream
        # would read it before it is written.
        poison_allocator("cuda", F32, [a[i].numel()] + [t.numel() for t in a if isinstance(t, torch.Tensor)])
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        a[i] = a[i] * 1.0
        got = case.bwd_call(tuple(a))
    torch.cuda.synchronize()
    for name, g, w in zip(case.arg_names, got, want):
        assert torch.equal(g, w), name


@requires_cuda
@pytest.mark.parametrize("case", each_op())
def test_backward_cuda_graph_capture(case):
    # No host synchronisation inside the backward op: capturable in a CUDA
    # graph (torch.compile mode="reduce-overhead" training steps) and replayable.
    a = list(case.bwd_args(case, case.bwd_graph_size, F32, "cuda"))
    i = case.bwd_upstream_index
    a[i] = a[i].clone()
    static = a[i]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        case.bwd_call(tuple(a))  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = case.bwd_call(tuple(a))
    fresh = torch.randn_like(static)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    a[i] = fresh
    for name, g, w in zip(case.arg_names, out, case.bwd_call(tuple(a))):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("cuda", [pytest.param("cuda", marks=DEVICE_PARAMS[1].marks)])
@pytest.mark.parametrize("case,size", sizes("bwd_cuda_cpu_sizes"))
def test_backward_cuda_matches_cpu_float64(case, size, cuda):
    a = case.bwd_args(case, size, F64, "cpu")
    want = case.bwd_call(a)
    got = case.bwd_call(tuple(t.to(cuda) if isinstance(t, torch.Tensor) else t for t in a))
    for name, g, w in zip(case.arg_names, got, want):
        scale = max(max_abs(w), 1.0)
        torch.testing.assert_close(g.cpu(), w, rtol=1e-10, atol=1e-12 * scale, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "case,size,grads",
    params(lambda c: [(f"{c.size_id(s)}-{bwd_grads_id(c, g)}", s, g) for s, g in c.bwd_accuracy]),
)
def test_backward_op_float32_accuracy(case, size, grads, device):
    # The backward op alone: given float64 forward values rounded to float32,
    # its float32 gradients are within float32 rounding of the float64
    # backward (no forward error involved).
    a = case.bwd_args(case, size, F64, device, grads)
    want = case.bwd_call(a)
    got = case.bwd_call(tuple(t.float() if isinstance(t, torch.Tensor) else t for t in a))
    gscale = max(max_abs(w) for w in want)
    for name, g, w in zip(case.arg_names, got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5 * gscale, msg=lambda m, n=name: f"{n}: {m}")

