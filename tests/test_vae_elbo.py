"""What only vae_elbo has (DESIGN.md section 2.3): PyTorch's BCE clamp of each
log at -100 where float32 p saturates (logits on both sides of the edges,
exact 0/1 targets, every CUDA path's inlined BCE), NaN propagation per row
(the reference refuses NaN probabilities), targets outside [0, 1] (an error
on the CPU, as in the reference: every position, route and dtype), and
stream order across chained calls of the cluster kernel (programmatic
dependent launch).

The contract it shares with the other ops (reference match, float32
accuracy, layouts, opcheck, autograd, determinism, bad inputs, CUDA streams
and graphs) is test_contract.py's, over op_cases.VAE_ELBO; the kernel paths
by name are test_cuda_paths.py's.
"""

import pytest
import torch

import fused_ops
from fused_test_utils import (
    DTYPES,
    check_error_names,
    make_vae_inputs as make_inputs,
    requires_cuda,
    run_with_baseline_isa,
    tol,
)
from op_cases import vae_reference

OUT_NAMES = ("elbo", "recon", "kl")


def fused(*args):
    return fused_ops.vae_elbo(*args)


def run_reference(args):
    with torch.no_grad():
        return vae_reference(*[a.detach() for a in args])


# ---------------------------------------------------------------------------
# Saturation, exact 0/1 targets, non-finite values
# ---------------------------------------------------------------------------


def _saturating_args(dtype, device, B=6, I=37, H=9, L=3):
    """Logits forced to +-40 on alternate columns (p == 1.0 and p == 0.0
    exactly in float32: exp(-40) < 2**-24 and 1 / (1 + exp(40)) ~ 4e-18 is
    not 0 but log(p) = -40 is; so also +-120, where p underflows to 0 and
    1 - p rounds to 0, both clamped at -100)."""
    args = make_inputs(B, I, H, L, dtype=dtype, device=device)
    w2, b2 = args[10], args[11]
    w2.zero_()
    pattern = torch.tensor([40.0, -40.0, 120.0, -120.0, 17.5, -17.5, 0.3], dtype=dtype)
    b2.copy_(pattern.repeat(I // len(pattern) + 1)[:I].to(device))
    return args


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_saturating_logits_clamp_like_reference(dtype, device):
    args = _saturating_args(dtype, device)
    x = args[0]
    x[:, ::3] = 0.0  # exact targets too, so both clamps are exercised alone
    x[:, 1::3] = 1.0
    want = run_reference(args)
    got = fused(*args)
    for name, g, w in zip(OUT_NAMES, got, want):
        torch.testing.assert_close(g, w, **tol(dtype), msg=lambda m, n=name: f"{n}: {m}")
    assert torch.isfinite(got[1]).all()
    if dtype == torch.float32:
        # A log-sigmoid rewrite would give ~120 per saturated element instead
        # of the clamped 100: the clamp is visible in the totals.
        p = torch.sigmoid(args[11].double().cpu()).float()
        assert (p == 1.0).any() and (p == 0.0).any()


@pytest.mark.parametrize("target", [0.0, 1.0])
def test_exact_targets(target, device):
    args = make_inputs(50, 33, 16, 4, device=device)
    args[0].fill_(target)
    want = run_reference(args)
    got = fused(*args)
    for name, g, w in zip(OUT_NAMES, got, want):
        torch.testing.assert_close(g, w, **tol(torch.float32), msg=lambda m, n=name: f"{n}: {m}")


def test_single_element_clamp_value(device):
    # One input, one saturated logit: recon is exactly the clamp value 100
    # (x = 0, p = 1: -(1 - 0) * max(log(0), -100) = 100), KL exact too.
    args = make_inputs(1, 1, 1, 1, device=device)
    args[0].fill_(0.0)
    args[10].zero_()
    args[11].fill_(50.0)
    _, recon, _ = fused(*args)
    assert recon.item() == 100.0
    assert torch.equal(recon, run_reference(args)[1])


# Logits on both sides of where float32 p saturates: p == 1 exactly once
# 1 + exp(-a) rounds to 1 (a > 24 ln 2 = 16.636), p == 0 once exp(-a)
# overflows (a < -88.72283935546875, the least float whose exp is inf).
# Short of p == 1, float32 p's rounding moves log(1 - p) by up to ~0.6 (a =
# 16.5), and the op follows the float32 formula there too.
SATURATED = [16.64, 17.0, 40.0, 88.8, 104.0, float("inf"), -88.72283935546875, -89.0, -104.0, -1e4, float("-inf")]
UNSATURATED = [0.0, 3.9, 4.1, 8.0, 12.0, 15.0, 16.0, 16.5, 16.63, -16.64, -87.0, -88.0, -88.7, -88.72283172607421875]


def _logit_columns(logits, B, H, device):
    """Inputs whose decoder logits are `logits` in every row (w_dec2 = 0),
    targets 0, 1 and uniform in turn."""
    args = make_inputs(B, len(logits), H, 2, device=device)
    args[10].zero_()
    args[11].copy_(torch.tensor(logits))
    args[0][0::3] = 0.0
    args[0][1::3] = 1.0
    return args


# B=3 runs the cluster kernel on CUDA, B=2048 the tiled one (H=8) or the
# wgmma one (H=256 on an sm_90a build): each has the BCE term inlined.
@pytest.mark.parametrize("B,H", [(3, 7), (2048, 8), (2048, 256)], ids=["B3", "B2048-tiled", "B2048-wgmma"])
@pytest.mark.parametrize("saturated", [True, False], ids=["saturated", "short-of-it"])
def test_bce_at_float32_saturation(B, H, saturated, device):
    logits = SATURATED if saturated else UNSATURATED
    p = 1.0 / (1.0 + torch.exp(-torch.tensor(logits)))
    assert (((p == 1.0) | (p == 0.0)) == saturated).all()
    args = _logit_columns(logits, B, H, device)
    got, want = fused(*args), run_reference(args)
    for name, g, w in zip(OUT_NAMES, got, want):
        torch.testing.assert_close(g, w, **tol(torch.float32), msg=lambda m, n=name: f"{n}: {m}")


# B=4 takes the cluster path on CUDA, B=2048 the tiled one (H % 8 == 0) or,
# at H = 256 on an sm_90a build, the wgmma one, whose splits of x into TF32
# parts must keep the NaN.  I = 32 puts all NaN logits of a row through
# the CPU kernel's SIMD BCE loop (I = 9 mostly through its scalar tail).
@pytest.mark.parametrize("I", [9, 32])
@pytest.mark.parametrize("B,H", [(4, 5), (2048, 8), (2048, 256)], ids=["B4", "B2048-tiled", "B2048-wgmma"])
def test_nan_propagates(B, H, I, device):
    # The reference refuses NaN probabilities (BCE's range check), so the rows
    # without NaN are compared with it and the NaN rows checked by hand.  A
    # NaN target is not a probability: the CPU raises for it, as the
    # reference does (test_invalid_target_raises_on_cpu); CUDA does not check
    # the targets' values and gives the row NaN.
    cuda = torch.device(device).type == "cuda"
    args = make_inputs(B, I, H, 2, device=device)
    if cuda:
        args[0][1, 3] = float("nan")  # a target (and through h everything) of row 1
    args[1][2, 0] = float("nan")  # eps of row 2: z, so recon and elbo, not kl
    elbo, recon, kl = fused(*args)
    nan_rows = [1, 2] if cuda else [2]
    assert torch.isnan(recon[nan_rows]).all() and torch.isnan(elbo[nan_rows]).all()
    assert torch.isfinite(kl[2]) and torch.isnan(kl[1]) == cuda
    keep = torch.tensor([r for r in range(B) if r not in nan_rows], device=device)
    want = run_reference([args[0][keep], args[1][keep], *args[2:]])
    for g, w in zip((elbo, recon, kl), want):
        torch.testing.assert_close(g[keep], w, **tol(torch.float32))
    # kl does not depend on eps: row 2's equals the reference's with any finite eps.
    row2 = run_reference([args[0][2:3], torch.zeros_like(args[1][2:3]), *args[2:]])
    torch.testing.assert_close(kl[2:3], row2[2], **tol(torch.float32))


# ---------------------------------------------------------------------------
# Targets outside [0, 1]: an error on the CPU, as in the reference
# ---------------------------------------------------------------------------

TRAIN = torch.ops.fused_ops.vae_elbo_train.default


def _cpu_routes():
    """The CPU entry points of the forward kernel, each ``(name, call)`` with
    ``call(args)`` running it: the op, the function without and with
    gradients (the latter through vae_elbo_train), and the module."""

    def module(args):
        m = fused_ops.nn.VAE(args[0].shape[1], args[2].shape[0], args[4].shape[0]).to(args[0].dtype)
        for p, a in zip(m.parameters(), args[2:]):
            p.data = a.detach()
        return m(args[0], eps=args[1])

    def with_grad(args):
        out = fused(*[a.detach().requires_grad_() for a in args])
        assert "vae_elbo_train" in type(out[0].grad_fn).__name__  # the training pair ran
        return out

    return [
        ("torch.ops", lambda args: torch.ops.fused_ops.vae_elbo(*args)),
        ("function", lambda args: fused(*args)),
        ("function-grad", with_grad),
        ("train-op", lambda args: TRAIN(*args)),
        ("module", module),
    ]


CPU_ROUTES = _cpu_routes()
# B = 130: three CPU row blocks of 64, the last partial.  I = 37: the float32
# BCE loop's vector body and its scalar tail (at either SIMD width).
INVALID_B, INVALID_I = 130, 37
# Positions: the first element, a vector-body element of the second block,
# the last element (the scalar tail of the partial block).
POSITIONS = [(0, 0), (70, 17), (INVALID_B - 1, INVALID_I - 1)]


def _invalid_values(dtype):
    fi = torch.finfo(dtype)
    return {
        "just_above_1": 1 + fi.eps,
        "1.5": 1.5,
        "huge": 1e30,
        "inf": float("inf"),
        "minus_inf": float("-inf"),
        "nan": float("nan"),
        "just_below_0": -fi.tiny,
        "negative_subnormal": -fi.tiny * fi.eps,
        "minus_1": -1.0,
    }


# Logits: as drawn (the float32 loop's all-vector route), saturated in every
# fifth column (vectors with a |logit| > 87 take the scalar libm route, the
# others the vector one), or saturated everywhere (the scalar route only).
LOGITS = {
    "drawn": None,
    "some_saturated": lambda b: b[::5].fill_(100.0),
    "all_saturated": lambda b: b.copy_(torch.tensor([100.0, -100.0], dtype=b.dtype).repeat(b.shape[0])[: b.shape[0]]),
}


def _invalid_target_args(dtype, logits, position, value):
    args = make_inputs(INVALID_B, INVALID_I, 8, 3, dtype=dtype)
    if LOGITS[logits] is not None:
        args[10].zero_()
        LOGITS[logits](args[11])
    args[0][position] = value
    return args


@pytest.mark.parametrize("route,call", CPU_ROUTES, ids=[r for r, _ in CPU_ROUTES])
@pytest.mark.parametrize("logits", list(LOGITS))
@pytest.mark.parametrize("position", POSITIONS, ids=lambda p: f"x{p[0]}-{p[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_invalid_target_raises_on_cpu(dtype, position, logits, route, call):
    # binary_cross_entropy raises for a target outside [0, 1] or NaN; the CPU
    # kernel checks the targets in its BCE loop and raises too, naming x and
    # the first offending element, rather than returning a finite loss.
    for name, value in _invalid_values(dtype).items():
        args = _invalid_target_args(dtype, logits, position, value)
        with pytest.raises(RuntimeError, match="should be between 0 and 1"):  # target (or p, NaN from x)
            run_reference(args)
        with pytest.raises(RuntimeError) as excinfo:
            call(args)
        check_error_names(excinfo, "x", r"\[0, 1\]")
        assert f"x[{position[0]}, {position[1]}] = " in str(excinfo.value), (name, str(excinfo.value))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_invalid_target_names_the_first_one(dtype):
    # Several invalid targets, in different row blocks: the message names the
    # first in row-major order, whichever thread's block flagged one first.
    args = make_inputs(INVALID_B, INVALID_I, 8, 3, dtype=dtype)
    args[0][129, 0] = 2.0
    args[0][65, 30] = -1.0
    args[0][65, 31] = float("nan")
    for threads in (1, 2):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with pytest.raises(RuntimeError, match=r"x\[65, 30\] = -1\b"):
                fused(*args)
        finally:
            torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_boundary_targets_are_valid(dtype):
    # 0, -0.0 and 1 are probabilities: accepted, and the losses the reference's.
    args = make_inputs(INVALID_B, INVALID_I, 8, 3, dtype=dtype)
    args[0][::3] = 0.0
    args[0][1::3] = -0.0
    args[0][2::3] = 1.0
    for (name, call) in CPU_ROUTES:
        got = call(args)
        for out, g, w in zip(OUT_NAMES, got, run_reference(args)):
            torch.testing.assert_close(g, w, **tol(dtype), msg=lambda m, n=out, r=name: f"{r} {n}: {m}")


def test_invalid_target_raises_with_the_baseline_isa(tmp_path):
    # The kernel's SSE2 build (16-byte lanes) checks the targets too.
    run_with_baseline_isa(
        tmp_path,
        "from fused_test_utils import make_vae_inputs\n"
        "for dt in (torch.float32, torch.float64):\n"
        "    for saturate in (False, True):\n"
        "        for r, c in ((0, 0), (70, 17), (129, 36)):\n"
        "            for v in (1.5, -1e-30, float('nan'), float('inf')):\n"
        "                args = make_vae_inputs(130, 37, 8, 3, dtype=dt)\n"
        "                if saturate:\n"
        "                    args[10].zero_(); args[11][::5] = 100.0\n"
        "                args[0][r, c] = v\n"
        "                try:\n"
        "                    fused_ops.vae_elbo(*args)\n"
        "                except RuntimeError as e:\n"
        "                    assert f'x[{r}, {c}] = ' in str(e), str(e)\n"
        "                else:\n"
        "                    raise AssertionError(f'no error for x[{r}, {c}] = {v} ({dt})')",
    )


# ---------------------------------------------------------------------------
# Stream order across calls
# ---------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("B,I,H,L", [(128, 784, 256, 1), (40, 64, 32, 1)])
def test_cuda_back_to_back_calls_see_the_previous_calls_outputs(B, I, H, L):
    # Stream order across calls: the cluster kernel may start while the
    # previous kernel in the stream still runs (programmatic dependent
    # launch) and waits for it before touching global memory.  Chain calls
    # whose eps is the previous call's kl (a view, so no other kernel runs
    # between them), unsynchronised, and compare with the same chain
    # synchronised after every call.  The outputs land in blocks the caching
    # allocator held NaN in (poisoned, then freed; every output is kept, so
    # none is recycled within the chain): a read before the previous call's
    # write would bring NaN.  A limit: a build without the wait passes this
    # test too on an H200 (the early start does not reach the eps read, ~13k
    # cycles into the kernel), so the wait rests on griddepcontrol's
    # contract; this test guards the stream-order property itself.
    args = make_inputs(B, I, H, L, device="cuda")

    def chain(sync):
        poison = [torch.full((B,), float("nan"), device="cuda") for _ in range(200)]
        torch.cuda.synchronize()
        del poison
        eps, outs = args[1], []
        for _ in range(30):
            out = fused(args[0], eps, *args[2:])
            outs.append(out)
            eps = out[2].view(B, 1)
            if sync:
                torch.cuda.synchronize()
        return torch.stack([torch.stack(o) for o in outs])

    want = chain(sync=True)
    assert torch.isfinite(want).all()
    assert torch.equal(chain(sync=False), want)


# ---------------------------------------------------------------------------
# Targets outside [0, 1] on CUDA: the row's recon and elbo are NaN
# ---------------------------------------------------------------------------


def _cuda_forward_paths():
    from op_cases import VAE_ELBO

    return [pytest.param(pc.path, pc.size, pc.dtype, id=f"{pc.path}-{'x'.join(map(str, pc.size))}",
                         marks=requires_cuda) for pc in VAE_ELBO.paths]


@pytest.mark.parametrize("path,size,dtype", _cuda_forward_paths())
def test_invalid_target_gives_nan_rows_on_cuda(path, size, dtype):
    # Checking the targets' values would cost a host synchronisation per call,
    # so CUDA does not raise: every kernel path gives a row with a target
    # outside [0, 1] (or NaN) a NaN recon and elbo, and the other rows are
    # untouched.
    from fused_ops import _paths

    B, I, H, L = size
    args = make_inputs(B, I, H, L, dtype=dtype, device="cuda")
    bad = {1: 1.5, B // 2: -1e-3, B - 1: float("nan")} if B > 2 else {0: 2.0}
    for r, v in bad.items():
        args[0][r, (r * 7) % I] = v
    with _paths.force("vae_elbo", path):
        elbo, recon, kl = fused(*args)
    assert _paths.last("vae_elbo") == path
    rows = torch.tensor(sorted(bad), device="cuda")
    assert torch.isnan(recon[rows]).all() and torch.isnan(elbo[rows]).all()
    for r, v in bad.items():  # kl reads x only through the encoder: NaN only from a NaN x
        assert torch.isnan(kl[r]) == (v != v), (r, v, kl[r].item())
    keep = torch.tensor([r for r in range(B) if r not in bad], device="cuda")
    if dtype == torch.bfloat16:  # against float64 on the same values, a few bfloat16 ulps
        want = run_reference([a.double() for a in (args[0][keep], args[1][keep], *args[2:])])
        for g, w in zip((elbo, recon, kl), want):
            atol = 4 * torch.finfo(dtype).eps * max(w.abs().max().item(), 1.0)
            torch.testing.assert_close(g[keep].double(), w, atol=atol, rtol=0)
        return
    want = run_reference([args[0][keep], args[1][keep], *args[2:]])
    for g, w in zip((elbo, recon, kl), want):
        torch.testing.assert_close(g[keep], w, **tol(dtype))
