"""Shared helpers of the fused_ops test suite (devices, seeds, input makers).

Imported by conftest.py and the test files (pytest puts tests/ on sys.path).
"""

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
