"""Integration with the rest of PyTorch, over the op table:

- ``torch.compile(dynamic=True)``: one compiled frame serves every tensor
  size (no recompile, counted by dynamo's compile counter), forward and
  backward matching eager at each size; an int argument of a schema
  (flow_euler's ``num_steps``) is specialised: a new value compiles anew;
- ``torch.use_deterministic_algorithms(True)``: every op runs forward and
  backward under it, bitwise as without it, on the CPU and on every CUDA
  kernel path (forced by name); the paths that call cuBLAS (through
  ``aten::mm``) need ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``), as
  every cuBLAS product in PyTorch does, and without it either run or fail
  with torch's message naming that variable.

CUDA variants skip without a GPU.
"""

import contextlib

import pytest
import torch
import torch._dynamo.testing

from contract_helpers import assert_equal, each_op
from fused_test_utils import CUDA_AVAILABLE, requires_cuda, sync, tol
from op_cases import CASES, F64, SMALL_SIZES, as_tuple

if CUDA_AVAILABLE:
    from fused_ops import _paths


def _grown(case, size, by):
    """Every tensor dimension of ``size`` grown by ``by`` (sizes of 1 would be
    specialised); the entries that are not (case.tensor_dims) stay."""
    dims = range(len(size)) if case.tensor_dims is None else case.tensor_dims
    return tuple(s + by if i in dims else s for i, s in enumerate(size))


def _loss(outs):
    return sum((i + 1) * o.sum() for i, o in enumerate(outs))


@pytest.mark.parametrize("case", each_op())
def test_compile_dynamic_has_no_recompiles(case, device):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda *a: as_tuple(case.fn(*a)), backend=counter,
                             dynamic=True, fullgraph=True)
    # The scalar arguments (flow_euler's num_steps, resample's num_samples)
    # stay: an int of the schema is specialised, each value its own graph.
    # A float one (ode_mlp's act_param) is specialised too: traced as a
    # symbolic float, dynamo would find the op takes a Python float and
    # restart the analysis, compiling the one frame twice.  An op without
    # gradients is checked forward only.
    scalars = case.scalars(SMALL_SIZES[case.name])
    for by in (0, 1, 3):
        size = _grown(case, SMALL_SIZES[case.name], by)
        args = case.inputs(size, device=device, requires_grad=case.differentiable)
        with torch._dynamo.config.patch(specialize_float=True):
            got = compiled(*case.op_args(args, size, scalars))
        want = case.call(case.fn, args, size, scalars)
        for name, g, w in zip(case.out_names, got, want):
            torch.testing.assert_close(g, w, **tol(torch.float32), msg=lambda m, n=name: f"{n} at {size}: {m}")
        if not case.differentiable:
            continue
        g_got = torch.autograd.grad(_loss(got), args)
        g_want = torch.autograd.grad(_loss(want), args)
        for name, g, w in zip(case.arg_names, g_got, g_want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"grad {n} at {size}: {m}")
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 sizes"


@contextlib.contextmanager
def _deterministic():
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _forward_backward(case, args, size, backward_op=False):
    """The outputs, then (a differentiable op) the gradients of every input;
    backward_op: through the function whose gradients run <op>_backward."""
    args = [a.detach().clone().requires_grad_(case.differentiable) for a in args]
    outs = case.fused_for_backward(args, size) if backward_op else case.fused(args, size)
    if not case.differentiable:
        return outs
    grads = torch.autograd.grad(_loss(outs), args)
    return (*outs, *grads)


@pytest.mark.parametrize("case", each_op("determinism_sizes"))
def test_deterministic_algorithms(case, device):
    size = case.determinism_sizes[0]
    args = case.inputs(size, device=device)
    want = _forward_backward(case, args, size)
    with _deterministic():
        got = _forward_backward(case, args, size)
    sync(device)
    names = (*case.out_names, *("grad_" + n for n in case.arg_names if case.differentiable))
    assert_equal(names, got, want)


def _path_params():
    out = []
    for case in CASES.values():
        for backward, rows in ((False, case.paths), (True, case.bwd_paths)):
            for pc in rows:
                op = f"{case.name}_backward" if backward else case.name
                dt = {F64: "f64", torch.bfloat16: "bf16"}.get(pc.dtype, "f32")
                out.append(pytest.param(case, op, pc, id=f"{op}-{pc.path}-{case.size_id(pc.size)}-{dt}"))
    return out


@requires_cuda
@pytest.mark.parametrize("config", [":4096:8", None], ids=["workspace_config", "no_workspace_config"])
@pytest.mark.parametrize("case,op,pc", _path_params())
def test_deterministic_algorithms_every_cuda_path(case, op, pc, config, monkeypatch):
    if pc.path in case.sm90_paths and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip(f"{op} path {pc.path!r} needs compute capability 9.0")
    if config is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    args = case.inputs(pc.size, dtype=pc.dtype, device="cuda")
    backward_op = op.endswith("_backward")
    with _paths.force(op, pc.path):
        want = _forward_backward(case, args, pc.size, backward_op)
        try:
            with _deterministic():
                got = _forward_backward(case, args, pc.size, backward_op)
                torch.cuda.synchronize()
        except RuntimeError as e:
            # Only cuBLAS may refuse, and only without the variable; the
            # message says what to set.
            assert config is None and "CUBLAS_WORKSPACE_CONFIG" in str(e), str(e)
            return
    assert _paths.last(op) == pc.path
    names = (*case.out_names, *("grad_" + n for n in case.arg_names if case.differentiable))
    assert_equal(names, got, want)
