"""The argument checks of csrc/common/checks.h, in Python, for the fake
(meta) implementations.

The C++ wrappers check every call before their kernels run; the fakes, which
``torch.compile``, ``torch.export`` and tensors on the ``meta`` device run
instead of the kernels, apply the same rules through these helpers, in the
same order and with the same messages, so a wrong shape or dtype is reported
the same way at trace time as at run time.  Each op states its rules once,
in one function of its module (``_importance_sampling.py``, ...), that its
fakes call; the contract tests (``test_contract.py::test_bad_inputs_meta``)
run every bad-input row of the op table on CPU tensors and on ``meta``
tensors and require the two messages to be identical, so the Python rules
and the C++ ones cannot drift apart.

A fake also runs when only some of the inputs are ``meta`` tensors (the
dispatcher picks the Meta kernel whenever one input is on ``meta``): the
device check then refuses the call, naming the tensor on the other device,
instead of returning uninitialised outputs on the first input's device.

Sizes may be symbolic (``torch.compile`` with dynamic shapes): every
condition goes through ``torch._check``, which records a guard or a runtime
assertion for a symbolic one and raises ``RuntimeError(message)`` for a
false concrete one.
"""

import torch

__all__ = [
    "check", "check_rank", "check_size", "check_same_float_dtype_and_device", "shape_str", "dtype_str",
    "device_str",
]

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.bool: "bool",
}
_FLOAT_DTYPES = (torch.float32, torch.float64)


def check(cond, *parts):
    """FUSED_OPS_CHECK: raises ``RuntimeError("".join(map(str, parts)))`` unless ``cond``.

    A plain bool is judged here; a symbolic one (a SymBool of a dynamic
    shape) goes to ``torch._check``, which records it as a guard.  (Dynamo
    in some torch releases cannot trace ``torch._check`` with a message
    closure, which the Python functions would otherwise hit under
    ``torch.compile`` for every static condition.)"""
    if isinstance(cond, bool):
        if not cond:
            raise RuntimeError("".join(str(p) for p in parts))
        return
    torch._check(cond, lambda: "".join(str(p) for p in parts))


def shape_str(t):
    """``[4, 16]``, as checks.h's shape_str writes it."""
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def dtype_str(dtype):
    return _DTYPE_NAMES.get(dtype, "a non-float32/float64 dtype")


def device_str(t):
    d = t.device
    if d.type == "cuda":
        return f"cuda:{0 if d.index is None else d.index}"
    return d.type


def check_rank(t, name, rank, layout):
    """The rank of ``t`` (first check of every tensor, so also where None is refused)."""
    if t is None:
        raise RuntimeError(f"{name} must be a {rank}-D tensor {layout}, got None")
    check(t.dim() == rank, name, " must be a ", rank, "-D tensor ", layout, ", got shape ", shape_str(t))


def check_size(t, name, dim, expected, what):
    check(t.shape[dim] == expected, name, ".shape[", dim, "] must be ", expected, " (", what, "), got shape ",
          shape_str(t))


def check_same_float_dtype_and_device(named, allow_bfloat16=False):
    """``named``: ``[(tensor, name), ...]``; all float32/float64 (or, with
    ``allow_bfloat16``, all bfloat16), the first's dtype, on the first's device."""
    first, first_name = named[0]
    ok = first.dtype in _FLOAT_DTYPES or (allow_bfloat16 and first.dtype == torch.bfloat16)
    check(ok, first_name, " must be float32 or float64, got ", dtype_str(first.dtype))  # csrc/common/checks.h's message
    for t, name in named[1:]:
        check(t.dtype == first.dtype, name, " must have the same dtype as ", first_name, " (",
              dtype_str(first.dtype), "), got ", dtype_str(t.dtype))
        check(t.device == first.device, name, " must be on the same device as ", first_name, " (",
              device_str(first), "), got ", device_str(t))
