"""The autograd contract of every fused op, written once over the op table
of op_cases.py: gradcheck (every output subset, each input alone, a
nonlinear loss), float64 and float32 gradients against the reference's
autograd, no graph from first-order gradients, double backward refused; and
the backward ops (torch.ops.fused_ops.<op>_backward) called directly:
opcheck, meta, layouts, determinism, bad inputs, linearity in the upstream
gradients, empty batch, CUDA streams and graphs, CUDA against CPU, float32
accuracy given float64 forward values.
"""

import pytest
import torch

from contract_helpers import (
    DTYPE_IDS,
    assert_close,
    bwd_grads_id,
    grads_of,
)
# Over the differentiable ops only (not resample, whose outputs are indices).
from contract_helpers import autograd_each_op as each_op, autograd_params as params, autograd_sizes as sizes
from fused_test_utils import (
    DEVICE_PARAMS,
    DTYPES,
    outputs_per_thread_count,
    poison_allocator,
    requires_cuda,
    sync,
)
from op_cases import F32, F64, all_subsets, max_abs, subset_id


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
        return sum((o * ci).sum() for o, ci in zip(out, c)) + case.nonlinear_loss(out)

    assert torch.autograd.gradcheck(loss, tuple(args), **case.gradcheck_tol)


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
# The backward ops (torch.ops.fused_ops.<op>_backward), called directly
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "case,size,grads",
    params(lambda c: [(f"{c.size_id(s)}-{bwd_grads_id(c, g)}", s, g) for s in c.bwd_opcheck_sizes
                      for g in c.bwd_opcheck_grads]),
)
def test_opcheck_backward_op(case, size, grads, dtype, device):
    a = case.bwd_args(case, size, dtype, device, grads)
    result = torch.library.opcheck(case.bwd, case.bwd_op_args(a))
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


@pytest.mark.parametrize("case,bad", params(lambda c: [(b.id, b) for b in c.bwd_bad if not b.cuda_only]))
def test_backward_op_bad_inputs_meta(case, bad):
    # The backward's fake states the C++ checks again: on meta tensors every
    # row fails with the CPU kernel's message, word for word.
    a = bad.modify(case.bwd_args(case, case.bwd_bad_size, F32, "cpu"))
    with pytest.raises(RuntimeError) as cpu:
        case.bwd_call(a)
    with pytest.raises(RuntimeError) as meta:
        case.bwd_call(tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in a))
    assert str(meta.value) == str(cpu.value)


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
