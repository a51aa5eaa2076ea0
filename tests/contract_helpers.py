"""Parametrisation and comparison helpers of the contract tests
(test_contract.py, test_contract_autograd.py) over the op table."""

import pytest
import torch

from op_cases import CASES

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


# The ops with an autograd contract (test_contract_autograd.py).
DIFFERENTIABLE = tuple(name for name, case in CASES.items() if case.differentiable)


def autograd_params(fn):
    return params(fn, ops=DIFFERENTIABLE)


def autograd_each_op(attr=None):
    return autograd_params(lambda c: [("",)] if attr is None or getattr(c, attr) else [])


def autograd_sizes(attr):
    return autograd_params(lambda c: [(c.size_id(s), s) for s in getattr(c, attr)])


def assert_equal(names, got, want):
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.equal(g, w), f"{name} differs bitwise: max |diff| = {(g - w).abs().max().item()}"


def assert_close(names, got, want, **kw):
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, msg=lambda m, n=name: f"{n}: {m}", **kw)


def check_meta(case, out, size, dtype, device):
    shapes = case.out_shapes(size)
    dtypes = case.out_dtypes(dtype) if case.out_dtypes is not None else [dtype] * len(shapes)
    assert len(out) == len(shapes)
    for name, t, shape, want_dtype in zip(case.out_names, out, shapes, dtypes):
        assert tuple(t.shape) == tuple(shape), (name, t.shape, shape)
        assert t.dtype == want_dtype and t.is_contiguous(), name
        assert t.device.type == torch.device(device).type, name


def entries(case):
    return [("torch.ops", case.packet), ("wrapper", case.fn)]


def grads_of(case, fn, args, size, upstream, subset):
    outs = case.call(fn, args, size)
    return torch.autograd.grad([outs[i] for i in subset], args, [upstream[i] for i in subset],
                               allow_unused=True, materialize_grads=True)


def bwd_grads_id(c, grads):
    return "+".join(n for n, g in zip(c.bwd_grad_names, grads) if g) or "none"
