"""The eager route of the Python functions (fused_ops._eager).

``fused_ops.importance_sampling``, ``flow_euler`` and ``vae_elbo`` skip the
Python autograd kernel that ``torch.library.register_autograd`` installs:
below the Autograd key when no gradient can flow, through the op's plain
``torch.autograd.Function`` when one can.  ``torch.ops.fused_ops.*`` called
directly goes through the registered kernel.  Both routes give bitwise the
same results, gradients and errors.  With the route disabled (what happens
when a private torch API it uses is missing) every call is the plain
``torch.ops`` call, again with the same results.
"""

import contextlib
import sys

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fused_ops
from fused_ops import _eager
from fused_test_utils import make_inputs


def _linear(n_out, n_in, scale=1.0):
    bound = scale / n_in**0.5
    return (torch.rand(n_out, n_in) * 2 - 1) * bound, (torch.rand(n_out) * 2 - 1) * bound


def _with_grad(args, device, requires_grad):
    args = [a.to(device) for a in args]
    return [a.requires_grad_() for a in args] if requires_grad else args


def _is_args(device, requires_grad=False):
    return make_inputs(37, 5, 3, device=device, requires_grad=requires_grad)


def _flow_args(device, requires_grad=False):
    b, d, h = 3, 4, 9
    params = [p for shape in ((h, d + 1), (h, h), (d, h)) for p in _linear(*shape)]
    return _with_grad([torch.randn(b, d), *params], device, requires_grad)


def _vae_args(device, requires_grad=False):
    b, i, h, l_ = 4, 6, 5, 3
    params = [p for shape in ((h, i), (l_, h), (l_, h), (h, l_), (i, h)) for p in _linear(*shape, scale=2.0)]
    return _with_grad([torch.rand(b, i), torch.randn(b, l_), *params], device, requires_grad)


# (Python function, the op it calls, input maker, extra scalar arguments)
CASES = {
    "importance_sampling": (fused_ops.importance_sampling, torch.ops.fused_ops.importance_sampling.default,
                            _is_args, ()),
    "flow_euler": (fused_ops.flow_euler, torch.ops.fused_ops.flow_euler.default, _flow_args, (3,)),
    "vae_elbo": (fused_ops.vae_elbo, torch.ops.fused_ops.vae_elbo.default, _vae_args, ()),
}


@contextlib.contextmanager
def autograd_kernel_calls():
    """Records the Python frames run from torch's custom-op autograd module
    (torch/_library/autograd.py: the kernel register_autograd installs)."""
    seen = []

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.replace("\\", "/").endswith("_library/autograd.py"):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profiler)
    try:
        yield seen
    finally:
        sys.setprofile(None)


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def _op_taken(name, op, device):
    """The op the Python function ``name`` calls when a gradient can flow:
    ``op``, except for vae_elbo on the CPU, which takes vae_elbo_train."""
    return torch.ops.fused_ops.vae_elbo_train.default if name == "vae_elbo" and device == "cpu" else op


def _assert_identical(got, expected):
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------
# The fast route
# ---------------------------------------------------------------------------


def test_every_private_api_of_the_fast_route_works_on_this_torch():
    # A torch that drops one turns the fast route off (correct, but slower):
    # this names the API instead of letting the slowdown pass unseen.
    assert _eager.unavailable == [] and _eager.enabled


def test_a_missing_private_api_is_reported(monkeypatch):
    monkeypatch.delattr(torch._C, "_any_requires_grad")
    problems = _eager._probe()
    assert len(problems) == 1 and problems[0].startswith("torch._C._any_requires_grad: AttributeError"), problems


@pytest.mark.parametrize("name", list(CASES))
def test_no_grad_calls_skip_the_autograd_kernel_with_identical_results(name, device):
    fn, op, make, extra = CASES[name]
    args = make(device)
    with torch.no_grad():
        expected = _outputs(op(*args, *extra))  # through the autograd kernel
        with autograd_kernel_calls() as seen:
            got = _outputs(fn(*args, *extra))
    assert seen == [], seen
    _assert_identical(got, expected)
    assert not any(g.requires_grad for g in got)


@pytest.mark.parametrize("name", list(CASES))
def test_plain_inputs_in_grad_mode_skip_it_too(name, device):
    fn, _, make, extra = CASES[name]
    with autograd_kernel_calls() as seen:
        out = _outputs(fn(*make(device), *extra))
    assert seen == [] and all(o.grad_fn is None for o in out)


@pytest.mark.parametrize("name", list(CASES))
def test_eager_calls_that_need_grad_use_the_ops_plain_function(name, device):
    # The plain Function, not the torch.func one (whose apply binds its
    # arguments through inspect.signature on every call).
    fn, op, make, extra = CASES[name]
    op = _op_taken(name, op, device)
    args = make(device, requires_grad=True)
    with autograd_kernel_calls() as seen:
        out = _outputs(fn(*args, *extra))
    assert seen == [], seen
    plain, _ = _eager.functions(op)
    assert type(out[0].grad_fn) is plain._backward_cls, type(out[0].grad_fn)
    grads = torch.autograd.grad(sum(o.sum() for o in out), args)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", list(CASES))
def test_direct_op_calls_that_need_grad_go_through_the_registered_kernel(name, device):
    # Also the check that autograd_kernel_calls() sees the kernel at all: if
    # torch moved it, this test fails instead of the others passing vacuously.
    _, op, make, extra = CASES[name]
    args = make(device, requires_grad=True)
    with autograd_kernel_calls() as seen:
        out = _outputs(op(*args, *extra))
    assert seen, "the autograd kernel was not entered"
    assert "GeneratedBackward" in type(out[0].grad_fn).__name__


@pytest.mark.parametrize("used", ["all-outputs", "first-output"])
@pytest.mark.parametrize("name", list(CASES))
def test_eager_function_and_registered_kernel_give_identical_gradients(name, used, device):
    # Both routes run the same setup_context and backward; with one output
    # used the others' gradients reach the backward op as None (neither route
    # materialises them).
    fn, op, make, extra = CASES[name]
    op = _op_taken(name, op, device)
    args = make(device, requires_grad=True)
    eager = _outputs(fn(*args, *extra))
    with autograd_kernel_calls() as seen:
        direct = _outputs(op(*args, *extra))[: len(eager)]
    assert seen
    _assert_identical(eager, direct)
    picked = range(len(eager)) if used == "all-outputs" else range(1)
    upstream = [torch.randn_like(eager[i]) for i in picked]
    # Which backward runs is the grad_fn's (on CUDA the engine runs it on its
    # device thread, out of autograd_kernel_calls()'s sight).
    assert "GeneratedBackward" not in type(eager[0].grad_fn).__name__
    assert "GeneratedBackward" in type(direct[0].grad_fn).__name__
    grads_eager = torch.autograd.grad([eager[i] for i in picked], args, upstream)
    grads_direct = torch.autograd.grad([direct[i] for i in picked], args, upstream)
    for a, g in zip(args, grads_eager):
        assert g.shape == a.shape and torch.isfinite(g).all()
    _assert_identical(grads_eager, grads_direct)


def test_under_grad_mode_off_inputs_that_require_grad_give_plain_outputs(device):
    args = _vae_args(device, requires_grad=True)
    with torch.no_grad(), autograd_kernel_calls() as seen:
        elbo, _, _ = fused_ops.vae_elbo(*args)
    assert seen == [] and elbo.grad_fn is None and not elbo.requires_grad


def test_inference_mode(device):
    args = _vae_args(device)
    with torch.inference_mode():
        got = fused_ops.vae_elbo(*args)
    _assert_identical(got, torch.ops.fused_ops.vae_elbo.default(*args))


def test_the_fast_route_is_not_taken_while_compiling(monkeypatch):
    # Under torch.compile the op itself must appear in the graph: the
    # dispatcher context of the fast route is not traceable.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    args = _vae_args("cpu")
    with torch.no_grad(), autograd_kernel_calls() as seen:
        _eager.call(torch.ops.fused_ops.vae_elbo.default, tuple(args))
    assert seen


# ---------------------------------------------------------------------------
# The fallback: every call is the plain torch.ops call
# ---------------------------------------------------------------------------


@pytest.fixture
def fallback(monkeypatch):
    monkeypatch.setattr(_eager, "enabled", False)


@pytest.mark.parametrize("used", ["all-outputs", "first-output"])
@pytest.mark.parametrize("name", list(CASES))
def test_fallback_gives_the_fast_routes_results_and_gradients(name, used, device, monkeypatch):
    fn, op, make, extra = CASES[name]
    args = make(device, requires_grad=True)
    fast = _outputs(fn(*args, *extra))
    picked = range(len(fast)) if used == "all-outputs" else range(1)
    upstream = [torch.randn_like(fast[i]) for i in picked]
    grads_fast = torch.autograd.grad([fast[i] for i in picked], args, upstream)

    monkeypatch.setattr(_eager, "enabled", False)
    with autograd_kernel_calls() as seen:
        plain = _outputs(fn(*args, *extra))
    assert seen, "the fallback did not call the registered kernel"
    assert "GeneratedBackward" in type(plain[0].grad_fn).__name__
    _assert_identical(plain, fast)
    _assert_identical(torch.autograd.grad([plain[i] for i in picked], args, upstream), grads_fast)


@pytest.mark.parametrize("name", list(CASES))
def test_fallback_without_grad_gives_the_fast_routes_results(name, device, monkeypatch):
    fn, _, make, extra = CASES[name]
    args = make(device)
    fast = _outputs(fn(*args, *extra))
    monkeypatch.setattr(_eager, "enabled", False)
    with autograd_kernel_calls() as seen:
        plain = _outputs(fn(*args, *extra))
    assert seen
    _assert_identical(plain, fast)
    assert all(o.grad_fn is None for o in plain)


@pytest.mark.parametrize("name", list(CASES))
def test_fallback_still_refuses_forward_ad(name, device, fallback):
    fn, _, make, extra = CASES[name]
    args = list(make(device))
    with fwAD.dual_level():
        args[0] = fwAD.make_dual(args[0], torch.ones_like(args[0]))
        with pytest.raises(RuntimeError, match="does not support forward-mode AD"):
            fn(*args, *extra)


@pytest.mark.parametrize("name", list(CASES))
def test_fallback_still_refuses_double_backward(name, device, fallback):
    fn, _, make, extra = CASES[name]
    args = make(device, requires_grad=True)
    out = _outputs(fn(*args, *extra))
    grads = torch.autograd.grad(sum(o.sum() for o in out), args, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(sum(g.sum() for g in grads), args, allow_unused=True)
