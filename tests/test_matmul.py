"""The matrix products under every op's kernels (csrc/common/matmul.h), through
the private op ``torch.ops.fused_ops._matmul``.

On CUDA a float32 product goes through the ``matmul`` path table: ``tf32x3``
(3xTF32 warpgroup tensor-core products, split-K for narrow outputs) or
``cublas``.  Each layout a kernel reads (row-major operands, transposed views
as the weight gradients read them) at odd and split-K sizes: against a
float64 product, within a small multiple of cuBLAS's own float32 error;
every element written (the hook fills its output with NaN first); bitwise
repeatable; the table's own choice by size; refusals of forced paths.
"""

import pytest
import torch
from fused_test_utils import requires_cuda

import fused_ops  # noqa: F401  (loads the library)

OP = torch.ops.fused_ops._matmul.default


def _operand(rows, cols, transposed, device, dtype=torch.float32, gen=None):
    """A [rows, cols] matrix, row-major or as the transposed view of a [cols, rows] one."""
    if transposed:
        return torch.randn(cols, rows, generator=gen, dtype=dtype).to(device).t()
    return torch.randn(rows, cols, generator=gen, dtype=dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matches_torch_on_the_cpu(ta, tb, dtype):
    gen = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 1, 1), (5, 7, 3), (33, 17, 65)]:
        a, b = _operand(m, k, ta, "cpu", dtype, gen), _operand(k, n, tb, "cpu", dtype, gen)
        torch.testing.assert_close(OP(a, b), a @ b, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)


def test_bad_inputs():
    a = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"b.shape\[0\] must be 4"):
        OP(a, torch.randn(5, 2))
    with pytest.raises(RuntimeError, match="b must have the same dtype as a"):
        OP(a, torch.randn(4, 2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="a must be a 2-D tensor"):
        OP(torch.randn(3), torch.randn(3, 2))


if torch.cuda.is_available():
    from fused_ops import _paths


# (m, n, k): odd edges and k tails; (784, 256, 8192) and (256, 784, 8192) are
# the VAE backward's weight gradients (split-K), (8192, 256, 784) its
# activation gradient.  Every edge a multiple of 4 along the contiguous axis.
TF32X3_SIZES = [(4, 4, 4), (12, 20, 36), (132, 260, 100), (256, 128, 4), (784, 256, 8192), (256, 784, 8192),
                (8192, 256, 784), (300, 64, 1028)]
LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]


def _errors(m, n, k, ta, tb, seed=0):
    """The tf32x3 product, its error against float64 and cuBLAS float32's."""
    gen = torch.Generator().manual_seed(seed)
    a64, b64 = _operand(m, k, ta, "cuda", torch.float64, gen), _operand(k, n, tb, "cuda", torch.float64, gen)
    a, b = a64.float(), b64.float()  # the cast keeps a transposed view's strides
    assert a.is_contiguous() != ta and b.is_contiguous() != tb
    exact = a.double() @ b.double()
    with _paths.force("matmul", "tf32x3"):
        got = OP(a, b)
    assert _paths.last("matmul") == "tf32x3"
    with _paths.force("matmul", "cublas"):
        plain = OP(a, b)
    assert _paths.last("matmul") == "cublas"
    return got, (got.double() - exact).abs().max().item(), (plain.double() - exact).abs().max().item(), (a, b)


@requires_cuda
@pytest.mark.parametrize("ta,tb", LAYOUTS, ids=["nn", "tn", "nt", "tt"])
@pytest.mark.parametrize("m,n,k", TF32X3_SIZES, ids=[f"{m}x{n}x{k}" for m, n, k in TF32X3_SIZES])
def test_cuda_tf32x3_is_float32_accurate(m, n, k, ta, tb):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tf32x3 path needs compute capability 9.0")
    got, err, err_cublas, (a, b) = _errors(m, n, k, ta, tb)
    assert not got.isnan().any(), "an element of the output was not written"
    scale = (a.abs().double() @ b.abs().double()).max().item()
    assert err <= 4 * err_cublas + 2.0**-22 * scale, (err, err_cublas, scale)
    with _paths.force("matmul", "tf32x3"):
        again = OP(a, b)
    assert torch.equal(got, again), "not bitwise repeatable"


@requires_cuda
def test_cuda_tf32x3_propagates_nan_and_inf():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tf32x3 path needs compute capability 9.0")
    a, b = torch.randn(256, 64, device="cuda"), torch.randn(64, 192, device="cuda")
    a[3, 5] = float("nan")
    a[7, 2] = float("inf")
    with _paths.force("matmul", "tf32x3"):
        got = OP(a, b)
    assert got[3].isnan().all() and not got[7].isfinite().all()
    rest = torch.ones(256, dtype=torch.bool)
    rest[[3, 7]] = False
    torch.testing.assert_close(got[rest], (a @ b)[rest], rtol=1e-5, atol=1e-4)


@requires_cuda
@pytest.mark.parametrize(
    "m,n,k,path",
    [(8192, 256, 784, "tf32x3"), (784, 256, 8192, "tf32x3"), (64, 64, 4096, "tf32x3"), (8192, 32, 256, "cublas"),
     (100, 100, 100, "cublas"), (8192, 256, 783, "cublas")],
)
def test_cuda_natural_choice(m, n, k, path):
    # (8192, 32, ...): an edge below 64; (100, 100, 100): below 2^24
    # multiply-adds; k = 783: a row-major a's rows are not float4-aligned.
    want = "tf32x3" if path == "tf32x3" and torch.cuda.get_device_capability() == (9, 0) else "cublas"
    a, b = torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda")
    _paths.clear_last()
    got = OP(a, b)
    assert _paths.last("matmul") == want
    torch.testing.assert_close(got, a @ b, rtol=1e-4, atol=1e-3)


@requires_cuda
def test_cuda_forced_tf32x3_refuses_unaligned_operands():
    a, b = torch.randn(64, 30, device="cuda"), torch.randn(30, 64, device="cuda")
    with _paths.force("matmul", "tf32x3"), pytest.raises(RuntimeError, match="forced kernel path 'tf32x3'"):
        OP(a, b)
    with _paths.force("matmul", "tf32x3"), pytest.raises(RuntimeError, match="forced kernel path 'tf32x3'"):
        OP(torch.randn(64, 33, device="cuda")[:, 1:], torch.randn(32, 64, device="cuda"))  # not 16-byte aligned


@requires_cuda
def test_cuda_tf32x3_under_cuda_graph_capture():
    # The split-K workspace comes from the graph's pool; replays recompute.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tf32x3 path needs compute capability 9.0")
    a = torch.randn(4096, 256, device="cuda").t()  # [256, 4096] read as a transposed view
    b = torch.randn(4096, 512, device="cuda")
    OP(a, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(a, b)
    assert _paths.last("matmul") == "tf32x3"
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, OP(a, b), rtol=0, atol=0)


# The hidden-layer epilogue (bias, per-row bias, activation) through the private
# op torch.ops.fused_ops._linear_act: (m, n, k) one tile with tails, several
# tiles, and a split-K product (one output tile over k = 4096: the partials'
# add applies the epilogue).
EPILOGUE_SIZES = [(132, 68, 100), (300, 260, 64), (128, 128, 4096)]
EPILOGUE_ACTS = [("silu", None), ("relu", None), ("leaky_relu", 0.2), ("elu", 0.7), ("selu", None),
                 ("gelu", None), ("gelu_tanh", None), ("softplus", 2.0), ("tanh", None), ("sigmoid", None)]


def _act_reference(name, p):
    """The op's (code, parameter) of an activation and its torch.nn.functional form."""
    from fused_ops.ops import _ode

    code, param = _ode._act(name, p)
    return code, param, lambda t: _ode._TORCH_ACTS[name](t, param)


@requires_cuda
@pytest.mark.parametrize("path", ["tf32x3", "cublas"])
@pytest.mark.parametrize("act,p", EPILOGUE_ACTS, ids=[a for a, _ in EPILOGUE_ACTS])
@pytest.mark.parametrize("m,n,k", EPILOGUE_SIZES, ids=[f"{m}x{n}x{k}" for m, n, k in EPILOGUE_SIZES])
def test_cuda_linear_act_epilogue(m, n, k, act, p, path):
    if path == "tf32x3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tf32x3 path needs compute capability 9.0")
    gen = torch.Generator().manual_seed(m + n + k)
    a64, w64 = torch.randn(m, k, generator=gen, dtype=torch.float64), torch.randn(n, k, generator=gen, dtype=torch.float64)
    b64, rb64 = torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(m, n, generator=gen, dtype=torch.float64)
    a, w, b, rb = (t.float().cuda() for t in (a64, w64, b64, rb64))
    code, param, ref = _act_reference(act, p)
    scale = (a64.abs() @ w64.abs().t()).max().item()
    with _paths.force("matmul", path):
        out, h = torch.ops.fused_ops._linear_act(a, w, b, rb, code, param, False)
        assert _paths.last("matmul") == path
        plain, _ = torch.ops.fused_ops._linear_act(a, w, b, None, -1, 0.0, False)
        inplace, empty = torch.ops.fused_ops._linear_act(a, w, b, rb, code, param, True)
    assert not out.isnan().any() and not h.isnan().any(), "an element of the output was not written"
    exact = a64 @ w64.t() + b64 + rb64
    assert (out.double().cpu() - exact).abs().max().item() <= 4e-6 * scale
    # The activation of the stored pre-activation, as torch computes it in float32.
    torch.testing.assert_close(h, ref(out), rtol=2e-6, atol=1e-6)
    assert torch.equal(inplace, h) and empty.numel() == 0
    # Without the row bias and activation: the bias alone, the same sums.
    torch.testing.assert_close(plain, out - rb, rtol=0, atol=4e-6 * scale)


@requires_cuda
def test_cuda_linear_act_bad_inputs():
    a, w = torch.randn(8, 4, device="cuda"), torch.randn(6, 4, device="cuda")
    op = torch.ops.fused_ops._linear_act
    with pytest.raises(RuntimeError, match=r"bias.shape\[0\] must be 6"):
        op(a, w, torch.randn(5, device="cuda"), None, 0, 0.0, False)
    with pytest.raises(RuntimeError, match="bias must be contiguous"):
        op(a, w, torch.randn(12, device="cuda")[::2], None, 0, 0.0, False)
    with pytest.raises(RuntimeError, match="w must be contiguous"):
        op(a, torch.randn(4, 6, device="cuda").t(), None, None, 0, 0.0, False)
    with pytest.raises(RuntimeError, match=r"row_bias.shape\[1\] must be 6"):
        op(a, w, None, torch.randn(8, 5, device="cuda"), 0, 0.0, False)
    with pytest.raises(RuntimeError, match="act must be an activation code"):
        op(a, w, None, None, 10, 0.0, False)
    with pytest.raises(RuntimeError, match="a must be a float32 CUDA tensor"):
        op(a.double(), w.double(), None, None, 0, 0.0, False)
