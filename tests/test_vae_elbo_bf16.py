"""bfloat16 inputs of vae_elbo: the op's contract (torch.ops takes them; a
float32 run on float32 copies where no bfloat16 path applies, the backward
always so) and the CUDA ``tiled_bf16`` path (bfloat16 tensor-core products
with float32 accumulation, large batches).

Accuracy rule (flash-attention's, tests/test_mixed_precision.py): against a
float64 run on the same bfloat16 values, the fused op's error is at most 2x
the plain PyTorch program's own error in bfloat16, plus one bfloat16 ulp of
the output's scale.  CUDA tests skip without a GPU.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_ops
from fused_test_utils import (
    VAE_ARG_NAMES, check_error_names, check_low_precision, make_vae_inputs, poison_allocator, requires_cuda,
)
from op_cases import vae_reference

BF16 = torch.bfloat16
OP = torch.ops.fused_ops.vae_elbo.default
BACKWARD_OP = torch.ops.fused_ops.vae_elbo_backward.default
EPS = torch.finfo(BF16).eps


def _inputs(B, I, H, L, device, requires_grad=False):
    args = [a.to(BF16) for a in make_vae_inputs(B, I, H, L, dtype=torch.float64, device=device)]
    return [a.requires_grad_() for a in args] if requires_grad else args


# ---------------------------------------------------------------------------
# The op's contract (CPU here; CUDA at sizes below the tensor-core batch)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("likelihood", [0, 1, 3])
def test_op_takes_bfloat16_as_float32_on_copies(likelihood, device):
    # No bfloat16 path at this size: the float32 op's results on the same
    # values, rounded once to bfloat16, bitwise.
    args = _inputs(37, 50, 13, 4, device)
    got = OP(*args, likelihood)
    want = OP(*[a.float() for a in args], likelihood)
    for g, w in zip(got, want):
        assert g.dtype == BF16 and torch.equal(g, w.to(BF16))


@pytest.mark.parametrize("upstream", [(True, True, True), (False, True, False), (True, False, False)])
def test_backward_op_takes_bfloat16_as_float32_on_copies(upstream, device):
    args = _inputs(37, 50, 13, 4, device)
    ups = [torch.randn(37, device=device).to(BF16) if u else None for u in upstream]
    got = BACKWARD_OP(*ups, *args)
    want = BACKWARD_OP(*[None if u is None else u.float() for u in ups], *[a.float() for a in args])
    for name, g, w, a in zip(VAE_ARG_NAMES, got, want, args):
        assert g.dtype == BF16 and g.shape == a.shape, name
        assert torch.equal(g, w.to(BF16)), name


def test_mixed_dtypes_refused_by_name(device):
    args = _inputs(6, 5, 7, 3, device)
    for i, other in ((5, torch.float32), (11, torch.float16), (1, torch.float64)):
        bad = list(args)
        bad[i] = bad[i].to(other)
        with pytest.raises(RuntimeError) as excinfo:
            OP(*bad)
        check_error_names(excinfo, VAE_ARG_NAMES[i], "same dtype")
    with pytest.raises(RuntimeError) as excinfo:
        BACKWARD_OP(None, None, torch.ones(6, device=device), *args)
    check_error_names(excinfo, "grad_kl", "same dtype")
    # float16 is not taken by the op (the Python function casts it).
    with pytest.raises(RuntimeError) as excinfo:
        OP(*[a.half() for a in args])
    check_error_names(excinfo, "x", "float32 or float64")


def test_fake_impls_return_bfloat16():
    args = [a.to("meta") for a in _inputs(11, 5, 7, 3, "cpu")]
    assert all(o.dtype == BF16 and o.shape == (11,) for o in OP(*args))
    grads = BACKWARD_OP(torch.ones(11, dtype=BF16, device="meta"), None, None, *args)
    assert all(g.dtype == BF16 and g.shape == a.shape for g, a in zip(grads, args))
    bad = list(args)
    bad[3] = bad[3].float()
    with pytest.raises(RuntimeError) as excinfo:
        OP(*bad)
    check_error_names(excinfo, "b_enc", "same dtype")


class _OpDtypes(TorchDispatchMode):
    """The dtype of x at each call of fused_ops::vae_elbo."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is OP:
            self.seen.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_function_passes_bfloat16_to_the_op(device):
    # fused_ops.vae_elbo hands bfloat16 inputs to the op (where the CUDA
    # bfloat16 path can take them); autocast keeps its float32 rule.
    args = _inputs(9, 6, 5, 3, device)
    with _OpDtypes() as mode:
        got = fused_ops.vae_elbo(*args)
    assert mode.seen == [BF16] and all(o.dtype == BF16 for o in got)
    with _OpDtypes() as mode, torch.autocast(torch.device(device).type, dtype=BF16):
        got = fused_ops.vae_elbo(*args)
    assert mode.seen == [torch.float32] and all(o.dtype == torch.float32 for o in got)


def test_compiled_bfloat16_call(device):
    torch._dynamo.reset()
    args = _inputs(20, 9, 8, 3, device)
    compiled = torch.compile(lambda *a: fused_ops.vae_elbo(*a), fullgraph=True)
    for g, w in zip(compiled(*args), fused_ops.vae_elbo(*args)):
        assert g.dtype == BF16 and torch.equal(g, w)


def test_bfloat16_gradients_within_the_rule(device):
    # Gradients (the float32 backward on float32 copies; on the CPU the
    # training pair) against float64, 2x the plain bfloat16 program's error.
    B, I, H, L = 64, 100, 64, 7
    args = _inputs(B, I, H, L, device)
    ups = [torch.randn(B, dtype=torch.float64, device=device).to(BF16) for _ in range(3)]

    fused_in = [a.detach().clone().requires_grad_() for a in args]
    fused = fused_ops.vae_elbo(*fused_in)
    exact_in = [a.detach().double().requires_grad_() for a in args]
    exact = vae_reference(*exact_in)
    plain_in = [a.detach().clone().requires_grad_() for a in args]
    plain = vae_reference(*plain_in)
    g_f = torch.autograd.grad(fused, fused_in, [u.to(o.dtype) for u, o in zip(ups, fused)])
    g_e = torch.autograd.grad(exact, exact_in, [u.double() for u in ups])
    g_p = torch.autograd.grad(plain, plain_in, ups)
    assert all(g.dtype == BF16 for g in g_f)
    check_low_precision(("elbo", "recon", "kl"), fused, plain, exact, EPS)
    check_low_precision(["grad_" + n for n in VAE_ARG_NAMES], g_f, g_p, g_e, EPS)


# ---------------------------------------------------------------------------
# The CUDA tiled_bf16 path
# ---------------------------------------------------------------------------


def _forced(path, args, likelihood=0):
    from fused_ops import _paths

    with _paths.force("vae_elbo", path):
        out = OP(*args, likelihood) if likelihood else fused_ops.vae_elbo(*args)
        torch.cuda.synchronize()
        assert _paths.last("vae_elbo") == path, _paths.last("vae_elbo")
    return out


SIZES = [(2048 + 37, I, H, L) for I in (784, 100) for H in (256, 128, 64) for L in (32, 20, 7)]
SIZES += [(4096, 784, 256, 32), (8192 + 5, 784, 256, 32), (2048, 37, 16, 1)]


@requires_cuda
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "B{}-I{}-H{}-L{}".format(*s))
def test_forced_tiled_bf16_accuracy(size):
    # Outputs no further from float64 (on the bfloat16 values) than the plain
    # bfloat16 program (2x + one ulp); outputs land in NaN-poisoned memory,
    # so an unwritten row fails; two calls agree bitwise.
    B = size[0]
    args = _inputs(*size, "cuda")
    poison_allocator("cuda", BF16, [B] * 3)
    got = _forced("tiled_bf16", args)
    assert all(o.dtype == BF16 and o.shape == (B,) for o in got)
    again = _forced("tiled_bf16", args)
    assert all(torch.equal(g, a) for g, a in zip(got, again))
    exact = vae_reference(*[a.double() for a in args])
    plain = vae_reference(*args)
    check_low_precision(("elbo", "recon", "kl"), got, plain, exact, EPS)


@requires_cuda
@pytest.mark.parametrize("size", [(2048 + 37, 784, 256, 32), (2048 + 37, 100, 64, 7)],
                         ids=lambda s: "B{}-I{}-H{}-L{}".format(*s))
def test_tiled_bf16_gradients(size):
    # The forward on tiled_bf16, the backward on float32 copies: gradients in
    # bfloat16 within the rule.
    from fused_ops import _paths

    B = size[0]
    args = _inputs(*size, "cuda")
    ups = [torch.randn(B, dtype=torch.float64, device="cuda").to(BF16) for _ in range(3)]
    fused_in = [a.detach().clone().requires_grad_() for a in args]
    fused = fused_ops.vae_elbo(*fused_in)
    assert _paths.last("vae_elbo") == "tiled_bf16"
    exact_in = [a.detach().double().requires_grad_() for a in args]
    exact = vae_reference(*exact_in)
    plain_in = [a.detach().clone().requires_grad_() for a in args]
    plain = vae_reference(*plain_in)
    g_f = torch.autograd.grad(fused, fused_in, ups)
    g_e = torch.autograd.grad(exact, exact_in, [u.double() for u in ups])
    g_p = torch.autograd.grad(plain, plain_in, ups)
    assert all(g.dtype == BF16 and g.shape == a.shape for g, a in zip(g_f, args))
    check_low_precision(("elbo", "recon", "kl"), fused, plain, exact, EPS)
    check_low_precision(["grad_" + n for n in VAE_ARG_NAMES], g_f, g_p, g_e, EPS)


@requires_cuda
def test_tiled_bf16_natural_choice_and_fallbacks():
    from fused_ops import _paths

    args = _inputs(8192, 784, 256, 32, "cuda")
    fused_ops.vae_elbo(*args)
    assert _paths.last("vae_elbo") == "tiled_bf16"
    # Below the tensor-core batch, another likelihood, H % 16 != 0: the
    # float32 table on float32 copies, rounded (bitwise the float32 op's).
    for size, likelihood in (((2047, 784, 256, 32), 0), ((2085, 784, 256, 32), 1), ((2085, 784, 248, 32), 0)):
        args = _inputs(*size, "cuda")
        got = OP(*args, likelihood)
        assert _paths.last("vae_elbo") != "tiled_bf16", (size, likelihood)
        want = OP(*[a.float() for a in args], likelihood)
        assert all(torch.equal(g, w.to(BF16)) for g, w in zip(got, want)), (size, likelihood)


@requires_cuda
def test_forced_float32_path_runs_on_float32_copies():
    # A float32 path forced with bfloat16 inputs runs on their float32 copies.
    args = _inputs(2085, 784, 256, 32, "cuda")
    got = _forced("tiled", args)
    want = _forced("tiled", [a.float() for a in args])
    assert all(torch.equal(g, w.to(BF16)) for g, w in zip(got, want))


@requires_cuda
def test_tiled_bf16_noncontiguous_inputs():
    args = _inputs(2085, 100, 64, 7, "cuda")
    strided = [a.t().contiguous().t() if a.dim() == 2 else a for a in args]
    assert not strided[2].is_contiguous()
    got = _forced("tiled_bf16", strided)
    want = _forced("tiled_bf16", args)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@requires_cuda
def test_tiled_bf16_is_deterministic_across_batches():
    # Each row's outputs depend on that row only: the first rows of a larger
    # batch are bitwise those of the smaller one (fixed-order sums, no atomics).
    args = _inputs(4100, 784, 256, 32, "cuda")
    small = [args[0][:2085], args[1][:2085], *args[2:]]
    big = _forced("tiled_bf16", args)
    part = _forced("tiled_bf16", small)
    assert all(torch.equal(b[:2085], p) for b, p in zip(big, part))
