"""Shared helpers of the fused_ops test suite: devices, tolerances, input
makers of the three ops, error-message checks, poisoned allocations.

Imported by conftest.py, op_cases.py and the test files (pytest puts tests/
on sys.path).  No test file imports another test file: what two of them
share lives here or in op_cases.py.
"""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

CUDA_AVAILABLE = torch.cuda.is_available()

requires_cuda = pytest.mark.skipif(not CUDA_AVAILABLE, reason="needs a CUDA GPU")
requires_two_gpus = pytest.mark.skipif(
    not CUDA_AVAILABLE or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)

# Devices that can run here.
DEVICES = ["cpu"] + (["cuda"] if CUDA_AVAILABLE else [])
# What to parametrise over: "cuda" is always listed, so that on a machine
# without a GPU the CUDA variants show up as *skipped* rather than vanishing.
DEVICE_PARAMS = ["cpu", pytest.param("cuda", marks=requires_cuda)]

DTYPES = [torch.float32, torch.float64]

# The contract (DESIGN.md section 2): within atol=rtol=1e-4 of the same-dtype
# reference in float32; float64 must agree to near its own precision.
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}


def tol(dtype):
    return dict(atol=TOL[dtype], rtol=TOL[dtype])


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------
# Shared scaffolding of the three ops' test files
# ---------------------------------------------------------------------------


def arg_modifier(arg_names, **changes):
    """A function ``args -> args`` that replaces each named argument ``a`` by
    ``changes[name](a)`` (how the bad-input tables spell a broken call)."""

    def apply(args):
        named = dict(zip(arg_names, args))
        for name, change in changes.items():
            named[name] = change(named[name])
        return [named[n] for n in arg_names]

    return apply


def check_error_names(excinfo, arg, expected):
    """The error names the argument (as a whole word: "q_mu" does not match
    inside "q_mu_x") and says what was expected (a regex)."""
    msg = str(excinfo.value)
    assert re.search(rf"(?<![A-Za-z0-9_]){re.escape(arg)}(?![A-Za-z0-9_])", msg), f"message does not name {arg!r}: {msg}"
    assert re.search(expected, msg), f"message does not say {expected!r}: {msg}"


def outputs_per_thread_count(fn, thread_counts):
    """``{n: fn()}`` with torch's intra-op thread count set to each n in
    turn; the caller's thread count is restored."""
    saved = torch.get_num_threads()
    try:
        results = {}
        for n in thread_counts:
            torch.set_num_threads(n)
            results[n] = fn()
    finally:
        torch.set_num_threads(saved)
    assert torch.get_num_threads() == saved
    return results


def make_inputs(
    N,
    D,
    K,
    dtype=torch.float32,
    device="cpu",
    generator=None,
    scale=3.0,
    std_range=(0.5, 2.0),
    q_std_range=(1.0, 4.0),
    requires_grad=False,
):
    """Fresh random arguments ``(samples, mix_weights, mix_mus, mix_stds, q_mu, q_std)``.

    Drawn on the CPU with torch's global generator (seeded per test by the
    ``seed`` fixture) or ``generator``, then moved to ``device``, so a given
    seed gives the same values on every device.  The mixture parameters are
    deliberately not the module defaults: unnormalised positive weights,
    per-(k, d) standard deviations, a shifted, scaled proposal.
    """
    g = dict(generator=generator)

    def uniform(shape, lo, hi):
        return torch.rand(shape, dtype=dtype, **g) * (hi - lo) + lo

    samples = torch.randn(N, D, dtype=dtype, **g) * scale
    mix_weights = uniform((K,), 0.05, 2.0)  # positive, NOT normalised
    mix_mus = torch.randn(K, D, dtype=dtype, **g) * 2.0
    mix_stds = uniform((K, D), *std_range)
    q_mu = torch.randn(D, dtype=dtype, **g) * 0.5
    q_std = uniform((D,), *q_std_range)
    args = [t.to(device) for t in (samples, mix_weights, mix_mus, mix_stds, q_mu, q_std)]
    if requires_grad:
        args = [t.requires_grad_() for t in args]
    return tuple(args)


ARG_NAMES = ("samples", "mix_weights", "mix_mus", "mix_stds", "q_mu", "q_std")
FLOW_ARG_NAMES = ("x0", "w1", "b1", "w2", "b2", "w3", "b3")
VAE_ARG_NAMES = ("x", "eps", "w_enc", "b_enc", "w_mu", "b_mu", "w_logvar", "b_logvar",
                 "w_dec1", "b_dec1", "w_dec2", "b_dec2")


def _linear(out_f, in_f, dtype, scale=1.0):
    """nn.Linear's default initialisation (uniform in +-1/sqrt(fan_in)), times ``scale``."""
    bound = scale / in_f**0.5
    w = (torch.rand(out_f, in_f, dtype=dtype) * 2 - 1) * bound
    b = (torch.rand(out_f, dtype=dtype) * 2 - 1) * bound
    return w, b


def make_flow_args(B, D, H, dtype=torch.float32, device="cpu", x_scale=1.0, requires_grad=False):
    """``[x0, w1, b1, w2, b2, w3, b3]`` of flow_euler, drawn like ``nn.Linear``'s
    initialisation from the global generator on the CPU, then moved to
    ``device``: a seed gives the same values everywhere."""
    x0 = torch.randn(B, D, dtype=dtype) * x_scale
    w1, b1 = _linear(H, D + 1, dtype)
    w2, b2 = _linear(H, H, dtype)
    w3, b3 = _linear(D, H, dtype)
    args = [t.to(device) for t in (x0, w1, b1, w2, b2, w3, b3)]
    if requires_grad:
        args = [t.requires_grad_() for t in args]
    return args


def make_vae_inputs(B, I, H, L, dtype=torch.float32, device="cpu", weight_scale=2.0, requires_grad=False):
    """``[x, eps, w_enc, b_enc, ..., b_dec2]`` of vae_elbo, drawn on the CPU
    (global generator), then moved to ``device``.  Weights are nn.Linear's
    uniform(+-1/sqrt(fan_in)) times ``weight_scale`` so that the logits,
    logvar and the ReLU masks are not all tiny."""
    x = torch.rand(B, I, dtype=dtype)
    eps = torch.randn(B, L, dtype=dtype)
    params = []
    for n_out, n_in in ((H, I), (L, H), (L, H), (H, L), (I, H)):
        params += _linear(n_out, n_in, dtype, weight_scale)
    args = [t.to(device) for t in (x, eps, *params)]
    if requires_grad:
        args = [t.requires_grad_() for t in args]
    return args


def poison_allocator(device, dtype, numels, copies=12):
    """Fill memory the allocator is about to hand out with NaN.

    CUDA: the caching allocator keeps freed blocks and hands them out again
    for requests of the same rounded size, so NaN-filled blocks of the given
    sizes (``copies`` of each) and one large block that the large pool
    splits are what the op's next allocations get.  CPU: best effort; glibc
    malloc reuses freed small chunks for same-size requests, but large
    (mmap'ed, > 128 KiB) ones go back to the OS and come back zeroed, so
    there the check rests on the comparison with the reference.
    """
    nan = float("nan")
    blocks = [torch.full((max(int(n), 1),), nan, dtype=dtype, device=device) for n in numels for _ in range(copies)]
    if torch.device(device).type == "cuda":
        blocks.append(torch.full((64 << 20,), nan, dtype=torch.float32, device=device))
    sync(device)
    del blocks


def describe(args):
    return ", ".join(f"{n}{list(a.shape)}" for n, a in zip(ARG_NAMES, args))


def rounding_sensitivity(args, eps=2.0**-23):
    """First-order size of the change of each output when every unnormalised
    log weight ``lw_i`` is perturbed by ``eps * S_i``, where ``S_i`` is the
    magnitude of the quantities summed into ``lw_i`` (the responsibility-
    weighted ``sum_d 0.5 z^2 + |log std|`` of the mixture plus the proposal's).

    That is the error that rounding a log weight once in float32 can cause,
    which no float32 implementation avoids and whose effect on the outputs is
    amplified when a few samples dominate (large D): there the float32
    reference itself moves by more than 1e-4 when only its summation order
    changes.  Returns float64 ``(mean_bound [D], ess_bound [], lw_bound [N])``,
    computed from a float64 run of the reference on the same inputs.
    """
    from fused_ops import reference

    x, w, mu, sd, qm, qs = [a.detach().double() for a in args]
    z2 = ((x[:, None, :] - mu) / sd) ** 2
    log_comp = (-0.5 * z2 - sd.log()).sum(-1) + w.log()
    resp = torch.softmax(log_comp, -1)
    size_p = (0.5 * z2 + sd.log().abs()).sum(-1) + w.log().abs()
    del z2
    size_q = (0.5 * ((x - qm) / qs) ** 2 + qs.log().abs()).sum(-1)
    eta = eps * ((resp * size_p).sum(-1) + size_q)
    mean, ess, lw = reference.importance_sampling(x, w, mu, sd, qm, qs)
    wt = lw.exp()
    mean_bound = (wt[:, None] * (x - mean).abs() * eta[:, None]).sum(0)
    ess_bound = (2 * ess * wt * (1 - ess * wt)).abs().mul(eta).sum()
    lw_bound = eta + (wt * eta).sum()
    return mean_bound, ess_bound, lw_bound


def run_with_baseline_isa(tmp_path, body):
    """Runs ``body`` (Python source; ``torch``, ``fused_ops`` and
    ``reference`` imported, the seed set) in a child process with
    ATEN_CPU_CAPABILITY=default, which makes the CPU kernels take their
    baseline (SSE2) build instead of the AVX2 one picked at run time.  The
    child imports the fused_ops this process imported (installed, or built in
    place in a source tree) and can import the suite's helper modules
    (tests/ is on its path); ``body`` must raise on a mismatch."""
    import fused_ops

    script = tmp_path / "baseline_isa.py"
    script.write_text(
        "import torch, fused_ops\nfrom fused_ops import reference\ntorch.manual_seed(0)\n"
        + body + "\nprint('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(fused_ops.__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.path.dirname(os.path.abspath(__file__)),
                                                        os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


class Doubled(torch.nn.Module):
    """A parametrization (torch.nn.utils.parametrize) that doubles its tensor."""

    def forward(self, w):
        return 2 * w


def check_low_precision(names, got, plain, exact, eps, scale_min=1.0, what=""):
    """flash-attention's rule for a lower-precision run: each output of
    ``got`` is no further from the float64 run ``exact`` on the same values
    than the plain PyTorch program's output ``plain`` in the same dtype (2x),
    plus one ulp ``eps`` of the output's scale (at least ``scale_min``: the
    final rounding alone costs half of one).  Where the plain program
    overflows (its error is not finite) it sets no bound, and the output is
    held to the rounding of an exact result (half an ulp, doubled like the
    plain program's error) plus the same ulp."""
    def max_abs(t):
        return t.abs().max().item() if t.numel() else 0.0

    for name, g, p, e in zip(names, got, plain, exact):
        e = e.double()
        f, q = max_abs(g.double() - e), max_abs(p.double() - e)
        floor = eps * max(max_abs(e), scale_min)
        if not math.isfinite(q):
            q = floor / 2
        assert math.isfinite(f) and f <= 2 * q + floor, (
            f"{what}{name}: error {f:.3e} vs the plain program's {q:.3e} (bound 2x + {floor:.2e})")
