"""Every CUDA kernel path of every op, by name, through the dispatch tables'
debug hook (fused_ops._paths; csrc/common/dispatch.h).

For each path in op_cases' ``paths``: forced (``_paths.force``) at a size
where its condition holds, the call must take it (``_paths.last``), match
the reference, stay within a bound of a float64 run, and repeat bitwise.
For each size in ``natural``: the table's own choice is the expected path
(sizes as on an H200, 132 SMs, with the sm_90a kernels built), and the
result matches the reference and the CPU kernel.  A forced path that does
not apply raises and lists every path.  Each op's table must have exactly
the paths named in op_cases, each covered both ways, so a path cannot be
added, renamed or dropped without its tests.  Before each call under test
another path's call is made and its report checked, so a stale
``_paths.last`` cannot make a test pass.

All of it needs a CUDA GPU; on a machine without one it is skipped.
"""

import math

import pytest
import torch

from fused_test_utils import CUDA_AVAILABLE, check_low_precision, requires_cuda, tol
from op_cases import BF16, CASES, F32, F64, max_abs

pytestmark = requires_cuda

if CUDA_AVAILABLE:
    from fused_ops import _paths


def _skip_unless_supported(case, path):
    if path in case.sm90_paths and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip(f"{case.name} path {path!r} needs compute capability 9.0")


def _params(attr):
    out = []
    for case in CASES.values():
        for pc in getattr(case, attr):
            dt = _DTYPE_IDS[pc.dtype]
            out.append(pytest.param(case, pc, id=f"{case.name}-{pc.path}-{case.size_id(pc.size)}-{dt}"))
    return out


_DTYPE_IDS = {F32: "f32", F64: "f64", BF16: "bf16"}


def _check_low_precision(case, got, args, size, what=""):
    """bfloat16 rows: outputs in the inputs' dtype, within the
    lower-precision rule against a float64 run on the same (bfloat16) values
    (fused_test_utils.check_low_precision)."""
    assert all(g.dtype == args[0].dtype for g in got), [g.dtype for g in got]
    exact = case.ref([a.double() for a in args], size)
    plain = case.ref(args, size)
    check_low_precision([n + what for n in case.out_names], got, plain, exact, torch.finfo(args[0].dtype).eps)


def _prime(case, path, backward=False):
    """Run the smallest natural-choice case of another path first and check
    that it was reported: the call under test must then update ``last``
    itself, so a stale report cannot make a test pass."""
    op = f"{case.name}_backward" if backward else case.name
    others = [p for p in (case.bwd_natural if backward else case.natural) if p.path != path]
    if not others:  # a table of one path: the report cannot be stale in a telling way
        return
    other = min(others, key=lambda p: math.prod(v for v in p.size if isinstance(v, int)))
    if backward:
        args, upstream = _bwd_inputs(case, other.size, other.dtype)
        _grads(case, case.bwd_fn or case.fn, args, other.size, upstream)
    else:
        case.fused(case.inputs(other.size, dtype=other.dtype, device="cuda"), other.size)
    torch.cuda.synchronize()
    assert _paths.last(op) == other.path, (op, other, _paths.last(op))


def _check_reference(case, got, args, size, dtype):
    want = case.ref(args, size)
    if case.match_check is not None:
        case.match_check(case, got, want, args, dtype)
    else:
        for name, g, w in zip(case.out_names, got, want):
            torch.testing.assert_close(g, w, **tol(dtype), msg=lambda m, n=name: f"{n}: {m}")


def _table(case):
    return "\n".join(f"  {n}: {when}" for n, when, _ in _paths.table(case.name))


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_table_names_every_path_and_each_has_tests(case):
    names = _paths.names(case.name)
    assert tuple(names) == case.path_names, f"{case.name}'s CUDA paths changed:\n{_table(case)}"
    assert {p.path for p in case.paths} == set(names), "a path without a forced test"
    assert {p.path for p in case.natural} == set(names), "a path that no natural-choice size reaches"
    bwd = f"{case.name}_backward"
    if case.bwd_path_names:
        assert tuple(_paths.names(bwd)) == case.bwd_path_names
        assert {p.path for p in case.bwd_paths} == set(case.bwd_path_names)
        assert {p.path for p in case.bwd_natural} == set(case.bwd_path_names)


@pytest.mark.parametrize("case,pc", _params("paths"))
def test_forced_path(case, pc):
    _skip_unless_supported(case, pc.path)
    size, dtype = pc.size, pc.dtype
    trials = 8
    err_fused = err_ref = scale = None
    for t in range(trials if dtype == F32 else 1):
        args = case.inputs(size, dtype=dtype, device="cuda")
        if t == 0:
            _prime(case, pc.path)
        with _paths.force(case.name, pc.path):
            got = case.fused(args, size)
            torch.cuda.synchronize()
            assert _paths.last(case.name) == pc.path, f"took {_paths.last(case.name)!r}:\n{_table(case)}"
            again = case.fused(args, size)
        for name, g, a in zip(case.out_names, got, again):
            assert torch.equal(g, a), f"{name} differs bitwise between two calls"
        if dtype == BF16:
            _check_low_precision(case, got, args, size)
            continue
        _check_reference(case, got, args, size, dtype)
        if dtype != F32:
            continue
        exact = case.ref([a.double() for a in args], size)
        ref32 = case.ref(args, size)
        n = len(got)
        if err_fused is None:
            err_fused, err_ref, scale = [0.0] * n, [0.0] * n, [0.0] * n
        for i in range(n):
            err_fused[i] += max_abs(got[i].double() - exact[i])
            err_ref[i] += max_abs(ref32[i].double() - exact[i])
            scale[i] += max(max_abs(exact[i]), 1.0)
    if err_fused is not None:
        for i, name in enumerate(case.out_names):
            floor = 8 * 2.0**-23 * scale[i]
            assert err_fused[i] <= pc.bound * err_ref[i] + floor, (
                f"{name} on {pc.path!r}: float32 error {err_fused[i]:.3e} vs the float32 reference's "
                f"{err_ref[i]:.3e} (bound {pc.bound}x + {floor:.1e}, summed over {trials} runs)")


@pytest.mark.parametrize("case,pc", _params("natural"))
def test_natural_choice(case, pc):
    _skip_unless_supported(case, pc.path)
    size, dtype = pc.size, pc.dtype
    args = case.inputs(size, dtype=dtype, device="cuda")
    _prime(case, pc.path)
    got = case.fused(args, size)
    torch.cuda.synchronize()
    assert _paths.last(case.name) == pc.path, (
        f"{case.name} at {size} ({pc.note or dtype}) took {_paths.last(case.name)!r}, "
        f"expected {pc.path!r}:\n{_table(case)}")
    for name, g, a in zip(case.out_names, got, case.fused(args, size)):
        assert torch.equal(g, a), f"{name} differs bitwise between two calls"
    cpu = case.fused([a.cpu() for a in args], size)
    if dtype == BF16:  # both devices within the bound (the CPU: float32 on float32 copies)
        _check_low_precision(case, got, args, size)
        _check_low_precision(case, cpu, [a.cpu() for a in args], size, " (CPU)")
        return
    _check_reference(case, got, args, size, dtype)
    if dtype == F32:
        # float32 CUDA and CPU kernels round differently; where the problem is
        # ill-conditioned (importance weights at D = 1024 hinge on log weights
        # of ~1e3) both may sit far from each other while each is as accurate
        # as the reference program: they must agree within twice its error.
        exact = case.ref([a.double() for a in args], size)
        ref32 = case.ref(args, size)
        for name, g, c, e, r in zip(case.out_names, got, cpu, exact, ref32):
            if not g.is_floating_point():  # indices: the same on both devices
                assert torch.equal(g.cpu(), c), f"{name} differs from the CPU's"
                continue
            allowed = 2 * max_abs(r.double() - e) + tol(dtype)["atol"] * max(max_abs(e), 1.0)
            assert max_abs(g.cpu().double() - c.double()) <= allowed, (
                f"{name} vs CPU: {max_abs(g.cpu().double() - c.double()):.3e} > {allowed:.3e}")
    else:
        for name, g, c in zip(case.out_names, got, cpu):
            torch.testing.assert_close(g.cpu(), c, **tol(dtype), msg=lambda m, n=name: f"{n} vs CPU: {m}")


@pytest.mark.parametrize("case,pc", _params("refused"))
def test_forced_path_that_does_not_apply_raises(case, pc):
    args = case.inputs(pc.size, dtype=pc.dtype, device="cuda")
    with _paths.force(case.name, pc.path):
        with pytest.raises(RuntimeError, match="does not apply") as excinfo:
            case.fused(args, pc.size)
            torch.cuda.synchronize()
    for name in _paths.names(case.name):  # the error lists every path
        assert name in str(excinfo.value), (name, str(excinfo.value))
    # Released: the next call chooses by itself again.
    case.fused(args, pc.size)
    assert _paths.last(case.name) != pc.path


def _grads(case, fn, args, size, upstream):
    outs = case.call(fn, args, size)
    return torch.autograd.grad(outs, args, upstream, allow_unused=True, materialize_grads=True)


def _bwd_inputs(case, size, dtype):
    if case.grad32_inputs is not None and dtype == F32:
        args = case.grad32_inputs(case, size, "cuda")
    else:
        args = case.inputs(size, dtype=dtype, device="cuda", requires_grad=True)
    with torch.no_grad():
        outs = case.fused(args, size)
    upstream = (case.grad32_upstream(outs, size) if case.grad32_upstream is not None
                else [torch.randn_like(o) for o in outs])
    return args, upstream


@pytest.mark.parametrize("case,pc", _params("bwd_paths"))
def test_forced_backward_path(case, pc):
    # The gradients through autograd with the backward op's path forced:
    # the path is taken, repeats bitwise, and meets the op's float32
    # gradient criterion against the reference (op_cases: grad32_check).
    bwd = f"{case.name}_backward"
    size = pc.size
    args, upstream = _bwd_inputs(case, size, pc.dtype)
    _prime(case, pc.path, backward=True)
    with _paths.force(bwd, pc.path):
        got = _grads(case, case.bwd_fn or case.fn, args, size, upstream)
        torch.cuda.synchronize()
        assert _paths.last(bwd) == pc.path, f"took {_paths.last(bwd)!r}"
        again = _grads(case, case.bwd_fn or case.fn, args, size, upstream)
    for name, g, a in zip(case.arg_names, got, again):
        assert torch.equal(g, a), f"grad {name} differs bitwise between two calls"
    if pc.dtype == F64:
        want = _grads(case, case.reference, args, size, upstream)
        rtol, atol = case.grad64_tol
        for name, g, w in zip(case.arg_names, got, want):
            scale = max(max_abs(w[torch.isfinite(w)]), 1.0)
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol * scale, msg=lambda m, n=name: f"grad {n}: {m}")
        return
    ref32 = _grads(case, case.reference, args, size, upstream)
    args64 = [a.detach().double().requires_grad_() for a in args]
    exact = _grads(case, case.reference, args64, size, [u.double() for u in upstream])
    subset = tuple(range(len(upstream)))
    case.grad32_check(case, got, ref32, exact, dict(subset=subset, upstream=upstream))


@pytest.mark.parametrize("case,pc", _params("bwd_natural"))
def test_natural_backward_choice(case, pc):
    bwd = f"{case.name}_backward"
    args, upstream = _bwd_inputs(case, pc.size, pc.dtype)
    _prime(case, pc.path, backward=True)
    _grads(case, case.bwd_fn or case.fn, args, pc.size, upstream)
    torch.cuda.synchronize()
    assert _paths.last(bwd) == pc.path, f"{bwd} at {pc.size} took {_paths.last(bwd)!r}, expected {pc.path!r}"


def test_clear_last_forgets_every_table():
    case = CASES["vae_elbo"]
    case.fused(case.inputs((5, 6, 7, 3), device="cuda"), (5, 6, 7, 3))
    assert _paths.last("vae_elbo") is not None
    _paths.clear_last()
    assert all(_paths.last(op, dev) is None for op, dev in _paths.tables())
