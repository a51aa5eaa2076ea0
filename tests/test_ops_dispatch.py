"""The Python functions of fused_ops.ops skip the Python autograd kernel that
torch.library.register_autograd installs (fused_ops.ops._call_op): below the
Autograd key when no gradient can flow, through the op's eager
torch.autograd.Function (ops._register_autograd) when one can.  Same results,
gradients and errors as calling torch.ops.fused_ops.* directly, which goes
through the registered kernel.
"""

import contextlib
import sys

import pytest
import torch

import fused_ops
from fused_ops import ops
from fused_test_utils import make_inputs
from test_flow_euler import make_args as make_flow_args
from test_vae_elbo import make_inputs as make_vae_inputs


def _is_args(device, requires_grad=False):
    return make_inputs(37, 5, 3, device=device, requires_grad=requires_grad)


def _flow_args(device, requires_grad=False):
    return make_flow_args(3, 4, 9, device=device, requires_grad=requires_grad)


def _vae_args(device, requires_grad=False):
    return make_vae_inputs(4, 6, 5, 3, device=device, requires_grad=requires_grad)


# (Python function, the op it calls, inputs, extra scalar arguments)
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
    """The op the Python function ``name`` calls: ``op``, except for
    vae_elbo on the CPU, which takes the vae_elbo_train op when a gradient
    can flow."""
    return torch.ops.fused_ops.vae_elbo_train.default if name == "vae_elbo" and device == "cpu" else op


@pytest.mark.parametrize("name", list(CASES))
def test_no_grad_calls_skip_the_autograd_kernel_with_identical_results(name, device):
    fn, op, make, extra = CASES[name]
    args = make(device)
    with torch.no_grad():
        expected = _outputs(op(*args, *extra))  # through the autograd kernel
        with autograd_kernel_calls() as seen:
            got = _outputs(fn(*args, *extra))
    assert seen == [], seen
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)
        assert not g.requires_grad


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
    plain = ops._EAGER_AUTOGRAD[op][0]
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
    for e, d in zip(eager, direct):
        torch.testing.assert_close(e, d, rtol=0, atol=0)
    picked = range(len(eager)) if used == "all-outputs" else range(1)
    upstream = [torch.randn_like(eager[i]) for i in picked]
    # Which backward runs is the grad_fn's (on CUDA the engine runs it on its
    # device thread, out of autograd_kernel_calls()'s sight).
    assert "GeneratedBackward" not in type(eager[0].grad_fn).__name__
    assert "GeneratedBackward" in type(direct[0].grad_fn).__name__
    grads_eager = torch.autograd.grad([eager[i] for i in picked], args, upstream)
    grads_direct = torch.autograd.grad([direct[i] for i in picked], args, upstream)
    for a, ge, gd in zip(args, grads_eager, grads_direct):
        assert ge.shape == a.shape and torch.isfinite(ge).all()
        torch.testing.assert_close(ge, gd, rtol=0, atol=0)


def test_under_grad_mode_off_inputs_that_require_grad_give_plain_outputs(device):
    args = _vae_args(device, requires_grad=True)
    with torch.no_grad(), autograd_kernel_calls() as seen:
        elbo, _, _ = fused_ops.vae_elbo(*args)
    assert seen == [] and elbo.grad_fn is None and not elbo.requires_grad


def test_inference_mode(device):
    args = _vae_args(device)
    with torch.inference_mode():
        got = fused_ops.vae_elbo(*args)
    expected = torch.ops.fused_ops.vae_elbo.default(*args)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_call_op_is_not_used_while_compiling(monkeypatch):
    # Under torch.compile the op itself must appear in the graph: the
    # dispatcher context of the fast path is not traceable.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    args = _vae_args("cpu")
    with torch.no_grad(), autograd_kernel_calls() as seen:
        ops._call_op(torch.ops.fused_ops.vae_elbo.default, tuple(args))
    assert seen
