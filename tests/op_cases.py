"""The suite's table of ops: one ``OpCase`` per op, read by test_contract.py.

An entry says everything the contract tests (DESIGN.md sections 2-4) need to
know about one op, so that each contract check is written once:

- how to call it: the Python function, the ``torch.ops`` overload, the
  reference program, argument and output names, extra scalar arguments
  (flow_euler's ``num_steps``), an input maker and the output shapes;
- which sizes each check runs at (odd ones included), with the tolerances
  that the op's numerics justify (section 2: float32 within atol=rtol=1e-4 of
  the float32 reference and no further from a float64 run than 2x the
  float32 reference's own error);
- its bad-input table (argument, how to break it, the expected message);
- its backward op and how to call it directly;
- its CUDA kernel paths (``fused_ops._paths``) with sizes that select each.

Sizes are tuples: importance_sampling (N, D, K); flow_euler (B, D, H, steps);
vae_elbo (B, I, H, L).  Not a test module: pytest collects nothing here.
"""

import itertools
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Optional

import torch

import fused_ops
from fused_ops import reference
from fused_test_utils import (
    ARG_NAMES as IS_ARG_NAMES,
    FLOW_ARG_NAMES,
    TOL,
    VAE_ARG_NAMES,
    arg_modifier,
    make_flow_args,
    make_inputs as make_is_inputs,
    make_vae_inputs,
    rounding_sensitivity,
    tol,
)

F32_ULP = 2.0**-23
F32, F64 = torch.float32, torch.float64


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def subset_id(names, subset):
    return "+".join(names[i] for i in subset)


def all_subsets(n):
    """Every non-empty subset of range(n), smallest first."""
    return [s for r in range(1, n + 1) for s in itertools.combinations(range(n), r)]


def max_abs(t):
    return t.abs().max().item() if t.numel() else 0.0


# ---------------------------------------------------------------------------
# Table rows
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Accuracy:
    """float32 against a float64 run of the reference, errors summed over
    ``trials`` fresh draws: fused <= bound * reference + floor, where floor is
    ``floor_ulps`` float32 ulps of the summed scales (an output's scale: its
    largest magnitude, at least ``scale_min``).  ``combine="max"`` asks for
    fused <= max(bound * reference, floor) instead."""

    size: tuple
    trials: int = 1
    bound: float = 2.0
    floor_ulps: float = 1.0
    combine: str = "sum"
    scale_min: float = 1.0
    make_kw: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Bad:
    """A broken call: ``modify(args) -> args``; the error must name ``arg`` and
    match ``expected``.  ``scalars`` replaces the op's scalar arguments."""

    id: str
    modify: Callable
    arg: str
    expected: str
    scalars: Optional[tuple] = None


@dataclass(frozen=True)
class BwdBad:
    """A broken call of the backward op: ``modify(bwd_args) -> bwd_args``, the
    error matches ``match``; ``cuda_only``: needs CUDA inputs."""

    id: str
    modify: Callable
    match: str
    cuda_only: bool = False


@dataclass(frozen=True)
class PathCase:
    """A size at which the CUDA path ``path`` applies (for the forced test)
    or is the natural choice (for the natural-choice test)."""

    path: str
    size: tuple
    dtype: Any = torch.float32
    note: str = ""
    bound: float = 2.0  # float32 error against float64, in units of the float32 reference's


@dataclass(frozen=True)
class OpCase:
    name: str
    fn: Callable  # fused_ops.<op>
    packet: Any  # torch.ops.fused_ops.<op>
    reference: Callable  # reference(*tensors, *scalars) -> outputs
    make: Callable  # make(size, dtype=, device=, requires_grad=, **kw) -> [tensors]
    arg_names: tuple
    out_names: tuple
    out_shapes: Callable  # size -> [shape per output]
    scalars: Callable = lambda size: ()
    size_id: Callable = lambda size: "x".join(map(str, size))
    # A fresh value of the first input with the maker's distribution (graph replays).
    fresh_first: Callable = torch.randn_like
    # -- forward numerics
    match_sizes: tuple = ()
    match_skip: Callable = lambda size, dtype, device: None  # -> reason or None
    match_check: Optional[Callable] = None  # (case, got, want, args, dtype) -> None; default: tol(dtype)
    single_run_check: Optional[Callable] = None  # (case, got, want, args, dtype) -> None; after match_check
    float64_tight: tuple = ()  # ((size, tol), ...)
    accuracy: tuple = ()
    invariants: Optional[Callable] = None  # (out, args, dtype) -> None; op-specific output properties
    # -- memory and layouts
    poison_sizes: tuple = ()
    poison_numels: Callable = lambda size: ()
    layouts: dict = field(default_factory=dict)  # name -> (args -> views, "noncontig" | "misaligned")
    layout_sizes: tuple = ()
    cpu_rounding_layouts: frozenset = frozenset()  # layouts the CPU BLAS rounds differently
    expanded: Optional[Callable] = None  # device -> (size, args with stride-0 views)
    expanded_bitwise: bool = True
    empty_size: Optional[tuple] = None
    # -- opcheck / meta / compile / determinism / bad inputs
    opcheck_sizes: tuple = ()
    meta_size: tuple = ()
    module: Optional[Callable] = None  # device -> (fused module, reference module, inputs)
    compile_size: tuple = ()
    compile_loss: Optional[Callable] = None  # outputs -> scalar
    compile_tol: dict = field(default_factory=dict)
    determinism_sizes: tuple = ()
    thread_size: tuple = ()
    bad_size: tuple = ()
    bad_inputs: tuple = ()
    cpu_cuda_mix_args: Optional[tuple] = None  # default: every argument
    # -- CUDA specifics
    stream_sizes: tuple = ()
    graph_sizes: tuple = ()
    cuda_cpu_float64: tuple = ()  # ((size, rtol, atol), ...)
    isa_sizes: tuple = ()
    isa_prepare: Optional[str] = None  # Python source run on `args` in the child (see test)
    # -- autograd
    gradcheck_sizes: tuple = ()  # ((size, fast_mode), ...)
    gradcheck_inputs: Optional[Callable] = None  # (case, size, device) -> float64 args requiring grad
    gradcheck_tol: dict = field(default_factory=dict)
    gradcheck_alone_size: tuple = ()
    grad64_sizes: tuple = ()  # ((size, subsets, make_kw), ...)
    grad64_tol: tuple = (1e-10, 1e-12)  # rtol, atol relative to max(|reference grad|, 1)
    grad32_sizes: tuple = ()  # ((size, subset), ...)
    grad32_inputs: Optional[Callable] = None  # (case, size, device) -> float32 args requiring grad
    grad32_upstream: Optional[Callable] = None  # (outs, size) -> [upstream per output]
    grad32_check: Optional[Callable] = None  # (case, got, ref32, exact, ctx) -> None
    nonlinear: Callable = torch.square  # a nonlinear term of each output in a gradcheck loss
    double_backward_match: str = "does not support double backward"
    # -- the backward op
    bwd: Any = None  # torch.ops.fused_ops.<op>_backward.default
    bwd_args: Optional[Callable] = None  # (case, size, dtype, device, grads) -> tuple
    bwd_grad_names: tuple = ()  # the backward op's upstream gradients, in order
    bwd_upstream_index: int = 0  # an upstream gradient in bwd_args (produced on a side stream)
    bwd_opcheck_sizes: tuple = ()
    bwd_opcheck_grads: tuple = ((True,),)
    bwd_meta_size: tuple = ()
    bwd_determinism_sizes: tuple = ()
    bwd_thread_size: Optional[tuple] = None
    bwd_bad_size: tuple = ()
    bwd_bad: tuple = ()
    bwd_empty_size: Optional[tuple] = None
    bwd_linearity_size: Optional[tuple] = None
    bwd_stream_size: tuple = ()
    bwd_graph_size: tuple = ()
    bwd_cuda_cpu_sizes: tuple = ()
    bwd_accuracy: tuple = ()  # ((size, grads), ...): float32 backward given float64 forward values
    # -- CUDA kernel paths (fused_ops._paths)
    paths: tuple = ()  # PathCase per path: forced on a size where it applies
    natural: tuple = ()  # PathCase: the path the table picks by itself at that size
    refused: tuple = ()  # PathCase: a forced path that does not apply -> RuntimeError
    bwd_paths: tuple = ()
    bwd_natural: tuple = ()
    # The CUDA path table's names in order of preference (fixed: tools and
    # docs name them), and the paths that need compute capability 9.0.
    path_names: tuple = ()
    bwd_path_names: tuple = ()
    sm90_paths: frozenset = frozenset()

    # -- calling
    @property
    def op(self):
        return self.packet.default

    def inputs(self, size, dtype=F32, device="cpu", requires_grad=False, **kw):
        return list(self.make(size, dtype=dtype, device=device, requires_grad=requires_grad, **kw))

    def call(self, fn, args, size, scalars=None):
        return as_tuple(fn(*args, *(self.scalars(size) if scalars is None else scalars)))

    def fused(self, args, size):
        return self.call(self.fn, args, size)

    def ref(self, args, size):
        return self.call(self.reference, args, size)

    def bwd_call(self, a):
        return self.bwd(*a)

    def __repr__(self):
        return self.name


# ---------------------------------------------------------------------------
# importance_sampling
# ---------------------------------------------------------------------------


def _is_match_check(case, got, want, args, dtype):
    """Within atol=rtol=1e-4 of the reference, or, in float32 at large D,
    within that plus twice the first-order effect of rounding every log
    weight once in float32 (rounding_sensitivity).

    At large D a few samples dominate and the outputs are ill-conditioned in
    float32: the float32 reference itself moves by more than 1e-4 (in ~3% of
    draws at D=128) when only its summation order changes.  Implementations
    that differ only in rounding order use at most 0.3x this allowance, so it
    hides no real error; the accuracy test bounds the accuracy proper."""
    t = TOL[dtype]
    inside = all(bool(((g - w).abs() <= t + t * w.abs()).all()) for g, w in zip(got, want))
    if dtype == F64 or inside:
        for name, g, w in zip(case.out_names, got, want):
            torch.testing.assert_close(g, w, **tol(dtype), msg=lambda m, n=name: f"{n}: {m}")
        return
    slack = rounding_sensitivity(args)
    for name, g, w, s in zip(case.out_names, got, want, slack):
        err = (g.double() - w.double()).abs()
        allowed = t + t * w.double().abs() + 2 * s
        bad = ~(err <= allowed)  # NaN counts as bad
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} elements outside atol=rtol=1e-4 + 2 x rounding sensitivity; "
            f"worst |diff| {err.max().item():.3e}, largest allowance {allowed.max().item():.3e}"
        )


def _is_invariants(out, args, dtype):
    # log_weights is normalised: an element never written (NaN, 0 or a stale
    # value) would break finiteness or logsumexp == 0.
    lw = out[2]
    assert torch.isfinite(lw).all()
    assert abs(torch.logsumexp(lw.double(), 0).item()) <= 10 * TOL[dtype]


def _transposed(t):  # same values, column-major strides
    return t.t().contiguous().t() if t.dim() == 2 else t


def _row_step(t):  # every other row (1-D: element) of a NaN-filled buffer
    big = t.new_full((2 * t.shape[0],) + tuple(t.shape[1:]), float("nan"))
    big[::2] = t
    return big[::2]


def _col_step(t):
    big = t.new_full((t.shape[0], 3 * t.shape[1]), float("nan"))
    big[:, ::3] = t
    return big[:, ::3]


def _offset(t):  # storage offset and padded rows
    big = t.new_full((t.shape[0] + 1, t.shape[1] + 2), float("nan"))
    big[1:, 2:] = t
    return big[1:, 2:]


def _strided(t):  # every tensor a strided slice of a larger one
    return torch.stack([t, torch.full_like(t, float("nan"))], -1)[..., 0]


def _misaligned(t):  # contiguous, one element into a buffer: not 16-byte aligned
    return torch.cat([t.new_full((1,), float("nan")), t.flatten()])[1:].view_as(t)


def _per_arg(**fns_by_index):
    """A layout that replaces argument i by fns_by_index['a<i>'](argument)."""
    table = {int(k[1:]): f for k, f in fns_by_index.items()}
    return lambda args: [table[i](a) if i in table else a for i, a in enumerate(args)]


def _every(fn):
    return lambda args: [fn(a) for a in args]


def _is_expanded(device):
    # Zero strides (broadcast views): a shared std per dimension, one weight for all.
    N, D, K = 1000, 7, 4
    args = list(make_is_inputs(N, D, K, device=device))
    args[1] = torch.rand((), device=device).add(0.5).expand(K)
    args[3] = torch.rand(1, D, device=device).add(0.5).expand(K, D)
    args[5] = torch.rand((), device=device).add(2.0).expand(D)
    return (N, D, K), args


def _is_module(device):
    module = fused_ops.nn.ImportanceSampler(16, 3).to(device)
    ref = reference.ImportanceSampler(16, 3).to(device)
    ref.load_state_dict(module.state_dict())
    return module, ref, (torch.randn(4096, 16, device=device) * 3,)


def _is_gradcheck_inputs(case, size, device):
    return case.inputs(size, dtype=F64, device=device, scale=1.5, requires_grad=True)


def _is_grad32_upstream(outs, size):
    mean, ess, lw = outs
    return [torch.randn_like(mean), torch.randn_like(ess), torch.randn_like(lw) / size[0] ** 0.5]


def _is_grad32_check(case, got, ref32, exact, ctx):
    """Nearly all of the fused float32 gradient's error comes from the float32
    forward outputs it is evaluated at (log_weights, ~3e-5 absolute at N=4096,
    D=16), not from the backward (test_contract's backward-op accuracy: ~1e-7
    of the scale given accurate forward outputs); sums like
    sum_i g_i (zq_i^2 - 1) amplify it, and the reference's float32 autograd
    happens to be hit less by its own forward error (the fused error exceeds
    twice the reference's by at most 1.25e-4 of the largest gradient element
    over many seeds and sizes).  So: the fused gradient is no further from
    float64 than twice the float32 reference's plus 3e-4 of the largest
    gradient element (of any input), and agrees with the float32 reference
    within rtol 1e-3 and 5e-4 of that scale plus 3x the reference's own error.

    With the ESS gradient alone and very peaked weights (N=333, D=33, K=7: ESS
    often within 1e-5 of 1) the whole gradient can be far below float32
    resolution: once float32 rounds the dominant weight to 1, d ess / d lw ~
    1 - w is lost to rounding, and the largest float64 gradient element can be
    1e-14.  So errors below 1e-6 |dL/d ess| count as float32 noise (the
    backward recomputes ess from log_weights for this reason)."""
    subset, upstream = ctx["subset"], ctx["upstream"]
    noise = 1e-6 * abs(upstream[1].item()) if 1 in subset else 0.0
    gscale = max(max_abs(e) for e in exact)
    for name, a, b, e in zip(case.arg_names, got, ref32, exact):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        err_fused = (a.double() - e).abs().max().item()
        err_ref = (b.double() - e).abs().max().item()
        assert err_fused <= 2 * err_ref + 3e-4 * gscale + noise, (name, err_fused, err_ref, gscale)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=5e-4 * gscale + 3 * err_ref + noise,
                                   msg=lambda m, n=name: f"grad {n} vs float32 reference: {m}")


def _is_bwd_args(case, size, dtype, device, grads=(True, True, True)):
    """Upstream gradients (None where not in ``grads``), the forward's inputs
    and its outputs weighted_mean and log_weights (the backward recomputes
    ess from log_weights)."""
    N, D, K = size
    args = case.inputs(size, dtype=dtype, device=device)
    mean, _, lw = fused_ops.importance_sampling(*args)
    opts = dict(dtype=dtype, device=device)
    ups = (torch.randn(D, **opts), torch.randn((), **opts), torch.randn(N, **opts))
    ups = tuple(u if g else None for u, g in zip(ups, grads))
    return (*ups, *args, mean, lw)


def _is_bad(**changes):
    return arg_modifier(IS_ARG_NAMES, **changes)


def _is_all(change):
    return _is_bad(**{n: change for n in IS_ARG_NAMES})


def _set(i, fn):
    """A modifier of a backward op's arguments that replaces argument i by fn(args)."""

    def apply(a):
        a = list(a)
        a[i] = fn(a)
        return tuple(a)

    return apply


def _is_size_params():
    return tuple((N, D, K) for N in (1, 7, 4096, 100003) for D in (1, 3, 16, 33, 128) for K in (1, 3, 8))


IMPORTANCE_SAMPLING = OpCase(
    name="importance_sampling",
    fn=fused_ops.importance_sampling,
    packet=torch.ops.fused_ops.importance_sampling,
    reference=reference.importance_sampling,
    make=lambda s, **kw: make_is_inputs(*s, **kw),
    arg_names=IS_ARG_NAMES,
    out_names=("weighted_mean", "ess", "log_weights"),
    out_shapes=lambda s: [(s[1],), (), (s[0],)],
    size_id=lambda s: "N{}-D{}-K{}".format(*s),
    fresh_first=lambda t: torch.randn_like(t) * 3,
    # The full cross product: on 2 CPU cores the largest case (float64
    # reference at N=100003, D=128, K=8, several 800 MB [N, K, D]
    # temporaries) takes ~4 s and runs once per dtype.
    match_sizes=_is_size_params(),
    match_check=_is_match_check,
    # One run's error is dominated by the float32 rounding of the few largest
    # log weights, a heavy-tailed random quantity for both implementations:
    # for an implementation as accurate as the reference one run exceeds the
    # 2x bound about once in 40, while errors summed over 32 fresh runs stay
    # below ~0.75 of it.  Summing keeps the test sensitive to a systematic
    # loss (a float32 sum over D=128 accumulated sequentially: ~3x the
    # reference's log-weight error).  The floor, one float32 ulp of each
    # run's scale, covers draws where one weight dominates and the float32
    # reference is exactly right (0 <= 2 * 0 would demand an error-free
    # result): far below the contract's 1e-4 and, for log_weights, below the
    # reference's own error.
    accuracy=tuple(Accuracy(s, trials=32) for s in
                   ((7, 3, 3), (1000, 33, 8), (4096, 16, 3), (1000, 128, 3), (100003, 3, 3))),
    invariants=_is_invariants,
    poison_sizes=((1, 1, 1), (7, 3, 2), (4097, 16, 3), (300007, 5, 3)),
    poison_numels=lambda s: (s[0], s[1], 1),
    layouts={
        "samples_transposed": (_per_arg(a0=_transposed), "noncontig"),
        "samples_col_step": (_per_arg(a0=_col_step), "noncontig"),
        "samples_row_step": (_per_arg(a0=_row_step), "noncontig"),
        "samples_offset": (_per_arg(a0=_offset), "noncontig"),
        "mix_mus_transposed": (_per_arg(a2=_transposed), "noncontig"),
        "mix_stds_col_step": (_per_arg(a3=_col_step), "noncontig"),
        "vectors_step": (_per_arg(a1=_row_step, a4=_row_step, a5=_row_step), "noncontig"),
        "all": (_per_arg(a0=_offset, a1=_row_step, a2=_transposed, a3=_col_step, a4=_row_step, a5=_row_step),
                "noncontig"),
    },
    layout_sizes=((257, 6, 3), (4099, 6, 3)),
    expanded=_is_expanded,
    opcheck_sizes=((1, 1, 1), (33, 5, 3)),
    meta_size=(11, 4, 2),
    module=_is_module,
    compile_size=(300, 5, 3),
    compile_loss=lambda o: o[0].sum() + 0.1 * o[1] + o[2].logsumexp(0) + o[2].mean(),
    # Inductor fuses the backward's reductions and sums in another order;
    # some gradients (q_std's: sums over N that nearly cancel) then differ by
    # ~1e-4 relative in float32: compare at the float32 contract.
    compile_tol=dict(rtol=1e-4, atol=1e-4),
    determinism_sizes=((100003, 16, 3),),
    thread_size=(100003, 16, 3),  # ~390 chunks of 256 samples
    bad_size=(6, 4, 3),
    bad_inputs=(
        Bad("samples_1d", _is_bad(samples=lambda t: t[0]), "samples", r"2-D"),
        Bad("samples_3d", _is_bad(samples=lambda t: t[None]), "samples", r"2-D"),
        Bad("mix_weights_2d", _is_bad(mix_weights=lambda t: t[None]), "mix_weights", r"1-D"),
        Bad("mix_mus_1d", _is_bad(mix_mus=lambda t: t[0]), "mix_mus", r"2-D"),
        Bad("mix_stds_1d", _is_bad(mix_stds=lambda t: t[0]), "mix_stds", r"2-D"),
        Bad("q_mu_2d", _is_bad(q_mu=lambda t: t[None]), "q_mu", r"1-D"),
        Bad("q_std_0d", _is_bad(q_std=lambda t: t[0]), "q_std", r"1-D"),
        Bad("mix_mus_D", _is_bad(mix_mus=lambda t: torch.cat([t, t[:, :1]], 1)), "mix_mus", r"\b4\b"),
        Bad("mix_stds_D", _is_bad(mix_stds=lambda t: t[:, :3]), "mix_stds", r"\b4\b"),
        Bad("q_mu_D", _is_bad(q_mu=lambda t: torch.cat([t, t])), "q_mu", r"\b4\b"),
        Bad("q_std_D", _is_bad(q_std=lambda t: t[:1]), "q_std", r"\b4\b"),
        Bad("mix_mus_K", _is_bad(mix_mus=lambda t: torch.cat([t, t[:1]])), "mix_mus", r"\b3\b"),
        Bad("mix_stds_K", _is_bad(mix_stds=lambda t: t[:2]), "mix_stds", r"\b3\b"),
        Bad("mix_mus_and_stds_K_vs_weights", _is_bad(mix_mus=lambda t: t[:2], mix_stds=lambda t: t[:2]),
            "mix_mus", r"\b3\b"),
        Bad("samples_int64", _is_bad(samples=lambda t: t.long()), "samples", r"float"),
        Bad("samples_int32_all_int", _is_all(lambda t: t.int()), "samples", r"float"),
        Bad("all_float16", _is_all(lambda t: t.half()), "samples", r"float32|float"),
        Bad("mix_mus_float64", _is_bad(mix_mus=lambda t: t.double()), "mix_mus", r"dtype"),
        Bad("q_std_float64", _is_bad(q_std=lambda t: t.double()), "q_std", r"dtype"),
        Bad("samples_float64", _is_bad(samples=lambda t: t.double()), "mix_weights", r"dtype"),
        Bad("N_0", _is_bad(samples=lambda t: t[:0]), "samples", r"N >= 1|at least one"),
        Bad("K_0", _is_bad(mix_weights=lambda t: t[:0], mix_mus=lambda t: t[:0], mix_stds=lambda t: t[:0]),
            "mix_weights", r"K >= 1|at least one"),
    ),
    stream_sizes=((1 << 20, 16, 3),),
    graph_sizes=((4096, 16, 3),),
    cuda_cpu_float64=(((2000, 8, 3), 1e-10, 1e-12),),
    isa_sizes=((1, 1, 1), (37, 3, 2), (4099, 16, 3), (300, 130, 5)),
    gradcheck_sizes=(((5, 3, 2), False), ((4, 1, 1), False), ((6, 4, 3), False)),
    gradcheck_inputs=_is_gradcheck_inputs,
    gradcheck_tol=dict(eps=1e-6, atol=1e-6, rtol=1e-5),
    gradcheck_alone_size=(5, 3, 2),
    grad64_sizes=(((300, 4, 3), all_subsets(3), dict(scale=1.5)),),
    grad64_tol=(1e-8, 1e-10),
    grad32_sizes=tuple(
        (s, sub) for s in ((4096, 16, 3), (1000, 5, 2), (333, 33, 7), (1, 3, 2),
                           (50, 2, 400))  # (50, 2, 400): CUDA keeps the coefficients in global memory
        for sub in ((0, 1, 2), (0,), (1,), (2,))
    ),
    grad32_upstream=_is_grad32_upstream,
    grad32_check=_is_grad32_check,
    nonlinear=lambda o: o.exp().square(),
    bwd=torch.ops.fused_ops.importance_sampling_backward.default,
    bwd_args=_is_bwd_args,
    bwd_grad_names=("grad_weighted_mean", "grad_ess", "grad_log_weights"),
    bwd_upstream_index=2,
    bwd_opcheck_sizes=((1, 1, 1), (33, 5, 3)),
    bwd_opcheck_grads=((True, True, True), (True, False, False), (False, True, True)),
    bwd_meta_size=(11, 4, 2),
    bwd_determinism_sizes=((20000, 16, 3),),
    bwd_thread_size=(30000, 7, 3),
    bwd_bad_size=(9, 3, 2),
    bwd_bad=(
        BwdBad("grad_mean-size", _set(0, lambda a: a[0][:-1]), r"grad_weighted_mean\.shape\[0\] must be"),
        BwdBad("grad_ess-rank", _set(1, lambda a: a[1][None]), r"grad_ess must be a 0-D tensor"),
        BwdBad("grad_lw-size", _set(2, lambda a: a[2][:-1]), r"grad_log_weights\.shape\[0\] must be"),
        BwdBad("grad_lw-dtype", _set(2, lambda a: a[2].double()),
               r"grad_log_weights must have the same dtype as samples"),
        BwdBad("mean-rank", _set(9, lambda a: a[9][None]), r"weighted_mean must be a 1-D tensor"),
        BwdBad("lw-size", _set(10, lambda a: a[10][:-1]), r"log_weights\.shape\[0\] must be"),
        BwdBad("samples-D", _set(3, lambda a: a[3][:, :-1]), r"mix_mus\.shape\[1\] must be"),
    ),
    bwd_linearity_size=(40, 3, 2),
    bwd_stream_size=(1 << 18, 16, 3),
    bwd_graph_size=(4096, 16, 3),
    # The CUDA backward's ways: entries split over sample slices, one thread
    # per entry for long rows, coefficients in global memory for large K.
    bwd_cuda_cpu_sizes=((4096, 16, 3), (129, 700, 3), (50, 2, 400), (1, 1, 1)),
    # (333, 33, 7) has very peaked weights (ESS ~ 1-2), where the ESS term
    # 2 w (S - w) / S^2 cancels at the dominant sample.
    bwd_accuracy=tuple((s, g) for s in ((4096, 16, 3), (333, 33, 7))
                       for g in ((True, True, True), (False, True, False))),
    paths=(
        # One run's error against float64 is heavy-tailed here (the few
        # largest log weights): 3x over eight runs, not the summed 32-run 2x.
        PathCase("fast", (4096, 16, 3), bound=3),
        PathCase("fast", (1 << 20, 16, 3), note="many blocks", bound=3),
        PathCase("general", (4096, 1024, 3), note="D above the fast path's register rows", bound=3),
        PathCase("general", (4096, 16, 3), note="the general path applies everywhere", bound=3),
    ),
    natural=(
        PathCase("fast", (4096, 16, 3)),
        PathCase("fast", (1 << 20, 16, 3)),
        PathCase("fast", (1000, 512, 3)),
        PathCase("general", (1000, 1024, 3)),
    ),
    refused=(PathCase("fast", (1000, 1024, 3)),),
    path_names=("fast", "general"),
    bwd_path_names=("tiled",),
    bwd_paths=(PathCase("tiled", (4096, 16, 3)),),
    bwd_natural=(PathCase("tiled", (4096, 16, 3)), PathCase("tiled", (1 << 20, 16, 3))),
)


# ---------------------------------------------------------------------------
# flow_euler
# ---------------------------------------------------------------------------


def _flow_make(s, **kw):
    B, D, H = s[:3]
    return make_flow_args(B, D, H, **kw)


def _flow_expanded(device):
    # x0 as a stride-0 broadcast of one row.  (Rows are not bitwise equal on
    # the CPU: the BLAS treats a row differently by its position in a block.)
    args = make_flow_args(1, 6, 20, device=device)
    args[0] = args[0].expand(5, 6)
    return (5, 6, 20, 3), args


def _flow_module(device):
    module = fused_ops.nn.FlowODE(16, 6).to(device)
    ref = reference.FlowODE(16, 6).to(device)
    ref.load_state_dict(module.state_dict())
    return module, ref, (torch.randn(10, 16, device=device),)


def _flow_gradcheck_inputs(case, size, device):
    return case.inputs(size, dtype=F64, device=device, requires_grad=True)


def _flow_grad32_check(case, got, ref32, exact, ctx):
    """The float32 contract against the float32 reference, and no further
    from the float64 gradient than the float32 reference (2x), with a floor
    of 8 float32 ulps of the largest entry."""
    for name, g, w, e in zip(case.arg_names, got, ref32, exact):
        assert g.shape == w.shape and g.dtype == F32 and g.device == w.device, name
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"grad {n}: {m}")
        fused_err = (g.double() - e).abs().max().item()
        eager_err = (w.double() - e).abs().max().item()
        floor = 8 * F32_ULP * max_abs(e)
        assert fused_err <= max(2 * eager_err, floor), (name, fused_err, eager_err, floor)


def _flow_bwd_args(case, size, dtype, device, grads=(True,)):
    B, D, H, steps = size
    args = case.inputs(size, dtype=dtype, device=device)
    return (torch.randn(B, D, dtype=dtype, device=device), *args, steps)


def _flow_bad(**changes):
    return arg_modifier(FLOW_ARG_NAMES, **changes)


# (B, D, H, steps): every required B, D, steps value, hidden widths that are
# not multiples of 32, and sizes that reach each CUDA path (FLOW_NATURAL).
FLOW_SIZES = (
    (8, 64, 256, 32), (1, 64, 256, 1), (33, 64, 256, 2), (34, 64, 256, 2), (66, 64, 256, 2),
    (67, 64, 256, 2), (129, 64, 256, 3), (133, 64, 256, 2), (200, 64, 256, 1), (1, 1, 3, 1),
    (3, 5, 20, 2), (32, 100, 130, 7), (32, 64, 300, 3), (8, 64, 256, 100), (1, 100, 37, 32),
    (129, 100, 130, 7), (33, 5, 20, 2), (129, 1, 45, 100), (4096, 64, 256, 32), (129, 3, 300, 2),
    (8, 5, 1100, 2), (40, 3, 1100, 1),
)

FLOW_EULER = OpCase(
    name="flow_euler",
    fn=fused_ops.flow_euler,
    packet=torch.ops.fused_ops.flow_euler,
    reference=reference.flow_euler,
    make=_flow_make,
    arg_names=FLOW_ARG_NAMES,
    out_names=("x",),
    out_shapes=lambda s: [(s[0], s[1])],
    scalars=lambda s: (s[3],),
    size_id=lambda s: "B{}-D{}-H{}-S{}".format(*s),
    match_sizes=FLOW_SIZES,
    match_skip=lambda s, dtype, device: (
        "covered by the float32 run; float64 at this size is slow on CPU"
        if s[0] == 4096 and dtype == F64 and device == "cpu" else None),
    # A float32 computation in disguise would be ~1e-7 off.
    float64_tight=(((9, 6, 40, 10), 1e-12),),
    # A single run each; the floor of 4 float32 ulps of the largest |x|
    # covers sizes where both errors are a few roundings.
    accuracy=tuple(Accuracy(s, floor_ulps=4, combine="max", scale_min=0.0, make_kw=dict(x_scale=2.0)) for s in
                   ((8, 64, 256, 32), (32, 100, 130, 7), (4096, 64, 256, 32), (129, 100, 130, 100),
                    (8, 5, 1100, 2))),
    poison_sizes=((8, 64, 256, 3), (129, 100, 130, 2), (40, 3, 1100, 1)),
    poison_numels=lambda s: (s[0] * s[1], s[0] * s[2]),
    layouts={
        "transposed": (_every(_transposed), "noncontig"),
        "strided": (_every(_strided), "noncontig"),
        # The CUDA split and row paths read weights as float4s only where aligned.
        "misaligned": (_every(_misaligned), "misaligned"),
    },
    layout_sizes=((8, 64, 256, 4), (40, 64, 256, 4), (70, 64, 256, 4), (129, 5, 37, 4)),
    # The CPU's BLAS rounds differently for weights that do not start on a
    # 64-byte boundary (the op's docstring); the CUDA kernels do not.
    cpu_rounding_layouts=frozenset({"misaligned"}),
    expanded=_flow_expanded,
    expanded_bitwise=False,
    empty_size=(0, 4, 9, 3),
    opcheck_sizes=((1, 1, 3, 1), (5, 3, 10, 3)),
    meta_size=(11, 4, 9, 5),
    module=_flow_module,
    compile_size=(6, 4, 12, 3),
    compile_loss=lambda o: (o[0] ** 2).sum(),
    compile_tol=dict(rtol=1e-4, atol=1e-5),
    determinism_sizes=((8, 64, 256, 32), (4096, 64, 256, 4), (40, 3, 1100, 2)),
    thread_size=(300, 16, 40, 5),  # several CPU row blocks
    bad_size=(6, 4, 10, 2),
    bad_inputs=(
        Bad("steps_0", _flow_bad(), "num_steps", r"at least 1", scalars=(0,)),
        Bad("steps_negative", _flow_bad(), "num_steps", r"at least 1", scalars=(-3,)),
        Bad("x0_1d", _flow_bad(x0=lambda t: t[0]), "x0", r"2-D"),
        Bad("x0_3d", _flow_bad(x0=lambda t: t[None]), "x0", r"2-D"),
        Bad("w1_1d", _flow_bad(w1=lambda t: t[0]), "w1", r"2-D"),
        Bad("w1_no_time_column", _flow_bad(w1=lambda t: t[:, :4]), "w1", r"\b5\b"),
        Bad("w1_extra_column", _flow_bad(w1=lambda t: torch.cat([t, t[:, :1]], 1)), "w1", r"\b5\b"),
        Bad("b1_size", _flow_bad(b1=lambda t: t[:9]), "b1", r"\b10\b"),
        Bad("b1_2d", _flow_bad(b1=lambda t: t[None]), "b1", r"1-D"),
        Bad("w2_rows", _flow_bad(w2=lambda t: t[:9]), "w2", r"\b10\b"),
        Bad("w2_cols", _flow_bad(w2=lambda t: t[:, :9]), "w2", r"\b10\b"),
        Bad("b2_size", _flow_bad(b2=lambda t: torch.cat([t, t])), "b2", r"\b10\b"),
        Bad("w3_rows", _flow_bad(w3=lambda t: t[:3]), "w3", r"\b4\b"),
        Bad("w3_cols", _flow_bad(w3=lambda t: t[:, :9]), "w3", r"\b10\b"),
        Bad("b3_size", _flow_bad(b3=lambda t: t[:3]), "b3", r"\b4\b"),
        Bad("b3_0d", _flow_bad(b3=lambda t: t[0]), "b3", r"1-D"),
        Bad("D_0", _flow_bad(x0=lambda t: t[:, :0], w1=lambda t: t[:, :1], w3=lambda t: t[:0],
                             b3=lambda t: t[:0]), "x0", r"D >= 1"),
        Bad("x0_int64", _flow_bad(x0=lambda t: t.long()), "x0", r"float"),
        Bad("all_float16", _flow_bad(**{n: (lambda t: t.half()) for n in FLOW_ARG_NAMES}), "x0", r"float32"),
        Bad("w2_float64", _flow_bad(w2=lambda t: t.double()), "w2", r"dtype"),
        Bad("x0_float64", _flow_bad(x0=lambda t: t.double()), "w1", r"dtype"),
    ),
    stream_sizes=((8, 64, 256, 4), (4096, 64, 256, 4)),
    graph_sizes=((8, 64, 256, 8), (4096, 64, 256, 8)),
    cuda_cpu_float64=(((50, 7, 33, 6), 1e-12, 1e-12),),
    isa_sizes=((3, 5, 37, 3), (70, 16, 40, 2)),
    gradcheck_sizes=(((3, 2, 5, 1), False), ((3, 2, 5, 3), False)),
    gradcheck_inputs=_flow_gradcheck_inputs,
    gradcheck_tol=dict(eps=1e-6, atol=1e-8, rtol=1e-6),
    gradcheck_alone_size=(4, 3, 6, 2),
    # The backward has two modes on both devices: "resident" (num_steps * B
    # <= 512 and the activations of all steps fit 4 Mi elements) and
    # "streaming" (per-step recompute).  (64, 3, 11, 8): 512 stacked rows,
    # resident, the largest; (65, 3, 11, 8): streaming; (8, 4, 2100, 30): 240
    # rows but 6 n B H > 4 Mi elements, streaming.
    grad64_sizes=tuple((s, ((0,),), {}) for s in
                       ((17, 6, 30, 8), (37, 6, 30, 9), (64, 3, 11, 8), (65, 3, 11, 8), (8, 4, 2100, 30))),
    grad64_tol=(1e-10, 1e-12),
    # (300, 3, 37, 5): two CUDA column-sum chunks, the last ragged; (4096, 64,
    # 256, 3): the large-batch default (16 chunks), few steps for CPU time.
    grad32_sizes=tuple((s, (0,)) for s in ((8, 64, 256, 32), (1, 1, 3, 1), (33, 5, 20, 7), (129, 100, 130, 7),
                                           (300, 3, 37, 5), (4096, 64, 256, 3))),
    grad32_check=_flow_grad32_check,
    double_backward_match="double backward .* is not supported",
    bwd=torch.ops.fused_ops.flow_euler_backward.default,
    bwd_args=_flow_bwd_args,
    bwd_grad_names=("grad_x",),
    bwd_upstream_index=0,
    bwd_opcheck_sizes=((1, 1, 3, 1), (5, 3, 10, 3)),
    bwd_meta_size=(11, 4, 9, 2),
    bwd_determinism_sizes=((8, 64, 256, 8), (300, 3, 37, 3)),
    bwd_thread_size=(300, 16, 40, 5),
    bwd_bad_size=(4, 3, 7, 2),
    bwd_bad=(
        BwdBad("grad_x-shape", _set(0, lambda a: a[0][:, :2].contiguous()), "grad_x must have the shape of x0"),
        BwdBad("grad_x-dtype", _set(0, lambda a: a[0].double()), "grad_x must have the same dtype as x0"),
        BwdBad("steps_0", _set(8, lambda a: 0), "num_steps must be at least 1"),
        BwdBad("grad_x-device", _set(0, lambda a: a[0].cpu()), "grad_x must be on the same device as x0",
               cuda_only=True),
    ),
    bwd_empty_size=(0, 3, 7, 2),
    bwd_stream_size=(4096, 64, 256, 4),
    bwd_graph_size=(8, 64, 256, 8),
    bwd_cuda_cpu_sizes=((8, 64, 256, 8), (300, 3, 37, 3), (65, 3, 11, 8)),
    # Kernel paths on an H200 (132 SMs) with the sm_90a kernels built.
    paths=(
        PathCase("split", (8, 64, 256, 4), note="four blocks per row"),
        PathCase("split", (66, 64, 256, 2), note="two blocks per row, the most rows"),
        PathCase("row", (100, 64, 256, 2)),
        PathCase("cluster", (8, 32, 128, 4)),
        PathCase("cluster", (32, 64, 300, 3), note="long ragged k-segments"),
        PathCase("wgmma", (4096, 64, 256, 4)),
        PathCase("wgmma", (200, 64, 256, 1), note="one step: only the last exchange is waited for"),
        # 3xTF32 tensor-core products: within 4x the float32 reference's error.
        PathCase("tiled", (300, 16, 64, 3), bound=4),
        PathCase("tiled", (4096, 64, 256, 4), note="where the wgmma path would be chosen", bound=4),
        PathCase("general", (8, 64, 256, 4), F64),
        PathCase("general", (8, 64, 256, 4), note="the general path applies everywhere"),
    ),
    natural=(
        PathCase("split", (1, 64, 256, 1)), PathCase("split", (8, 64, 256, 32)), PathCase("split", (33, 64, 256, 2)),
        PathCase("split", (34, 64, 256, 2)), PathCase("split", (66, 64, 256, 2)),
        PathCase("row", (67, 64, 256, 2)), PathCase("row", (129, 64, 256, 3)), PathCase("row", (132, 64, 256, 2)),
        PathCase("wgmma", (133, 64, 256, 2)), PathCase("wgmma", (200, 64, 256, 1)),
        PathCase("wgmma", (4096, 64, 256, 32)),
        PathCase("cluster", (1, 1, 3, 1)), PathCase("cluster", (3, 5, 20, 2)), PathCase("cluster", (8, 32, 128, 4)),
        PathCase("cluster", (32, 100, 130, 7)), PathCase("cluster", (32, 64, 300, 3)),
        PathCase("tiled", (129, 100, 130, 7)), PathCase("tiled", (33, 5, 20, 2)), PathCase("tiled", (129, 1, 45, 4)),
        PathCase("tiled", (129, 3, 300, 2)), PathCase("tiled", (300, 16, 64, 3)),
        PathCase("general", (8, 5, 1100, 2)), PathCase("general", (40, 3, 1100, 1)),
        PathCase("general", (8, 64, 256, 4), F64), PathCase("general", (4096, 64, 256, 2), F64),
    ),
    refused=(PathCase("wgmma", (8, 64, 256, 2), F64), PathCase("split", (8, 32, 128, 2))),
    path_names=("split", "row", "cluster", "wgmma", "tiled", "general"),
    bwd_path_names=("resident", "streaming"),
    sm90_paths=frozenset({"split", "row", "cluster", "wgmma"}),
    bwd_paths=(
        PathCase("resident", (8, 64, 256, 32)),
        PathCase("resident", (64, 3, 11, 8), note="512 stacked rows, the largest"),
        PathCase("streaming", (65, 3, 11, 8)),
        PathCase("streaming", (129, 100, 130, 7)),
        PathCase("streaming", (8, 64, 256, 8), note="the streaming mode applies everywhere"),
    ),
    # resident: num_steps * B <= 512 and 6 num_steps B H <= 4 Mi elements.
    bwd_natural=(
        PathCase("resident", (8, 64, 256, 32)), PathCase("resident", (64, 3, 11, 8)),
        PathCase("streaming", (65, 3, 11, 8)), PathCase("streaming", (129, 100, 130, 7)),
        PathCase("streaming", (4096, 64, 256, 3)),
    ),
)


# ---------------------------------------------------------------------------
# vae_elbo
# ---------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _vae_meta_module(I, H, L):
    with torch.device("meta"):  # no parameters drawn, no generator consumed
        return reference.VAE(I, H, L)


def vae_reference(x, eps, *params):
    """(elbo, recon, kl) of the reference module holding ``params``, as a
    differentiable function of every argument (functional_call)."""
    I, H, L = x.shape[-1], params[0].shape[0], params[2].shape[0]
    m = _vae_meta_module(I, H, L)
    names = [n for n, _ in m.named_parameters()]
    return tuple(torch.func.functional_call(m, dict(zip(names, params)), (x, eps)))


def vae_preactivations(args):
    """(encoder ReLU input, decoder hidden ReLU input, decoder logits) of the
    reference at ``args``, without autograd."""
    F = torch.nn.functional
    with torch.no_grad():
        x, eps, we, be, wm, bm, wl, bl, w1, b1, w2, b2 = args
        h = torch.relu(F.linear(x, we, be))
        z = F.linear(h, wm, bm) + torch.exp(0.5 * F.linear(h, wl, bl)) * eps
        pre_enc = F.linear(x, we, be)
        pre_dec = F.linear(z, w1, b1)
        logits = F.linear(torch.relu(pre_dec), w2, b2)
    return pre_enc, pre_dec, logits


def vae_gradcheck_inputs(case, size, device, max_logit=8.0, margin=1e-4, tries=100):
    """float64 inputs on which finite differences are accurate: every decoder
    logit within +-max_logit and every ReLU input at least ``margin`` from 0.

    BCE is computed from p = sigmoid(logit), so near saturation 1 - p keeps
    few significant bits: at logit 19 (1 - p = 4e-9) a step of 1e-6 moves p
    by ~40 ulps of 1.0 and the finite difference of log1p(-p) is off by
    ~1e-2, far beyond gradcheck's atol (the fused gradient then still equals
    the reference's autograd to 1e-14, and gradcheck fails on the reference
    as well).  A ReLU input within the step of 0 crosses the kink."""
    for _ in range(tries):
        args = case.inputs(size, dtype=F64, device=device)
        pre_enc, pre_dec, logits = vae_preactivations(args)
        if (max_abs(logits) <= max_logit
                and min(pre_enc.abs().min().item(), pre_dec.abs().min().item()) >= margin):
            return [t.requires_grad_() for t in args]
    raise AssertionError(f"no draw in {tries} kept the logits within {max_logit} and ReLU inputs off 0")


def vae_clear_of_relu_kinks(make, margin=2e-5, tries=100):
    """Inputs from make() whose ReLU pre-activations (encoder and decoder
    hidden layer) all lie at least ``margin`` from 0 in the float32 reference.

    Near a kink, float32 rounding decides which side a pre-activation falls
    on, and the two sides' gradients differ by O(1) for that unit and row: no
    two summation orders can be compared there.  At 128 x 256 units a random
    draw has one within 1e-6 of 0 about 6% of the time, so the float32
    comparisons redraw until every unit is clear (~3 draws)."""
    for _ in range(tries):
        args = make()
        pre_enc, pre_dec, _ = vae_preactivations(args)
        if min(pre_enc.abs().min().item(), pre_dec.abs().min().item()) > margin:
            return args
    raise AssertionError(f"no draw in {tries} kept every ReLU input {margin} away from 0")


def vae_assert_grads_close(names, got, want, rtol=1e-4, atol_scale=1e-5):
    """Per-input comparison, atol relative to the largest finite reference
    gradient of that input (weight gradients are sums over the batch)."""
    for name, g, w in zip(names, got, want):
        finite = w[torch.isfinite(w)]
        scale = max_abs(finite) if finite.numel() else 1.0
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol_scale * max(scale, 1e-3),
                                   msg=lambda m, n=name: f"grad {n}: {m}")


def _vae_grad32_inputs(case, size, device):
    return vae_clear_of_relu_kinks(lambda: case.inputs(size, device=device, requires_grad=True))


def _vae_grad32_check(case, got, ref32, exact, ctx):
    vae_assert_grads_close(case.arg_names, got, ref32)


def _vae_single_run_check(case, got, want, args, dtype):
    """In float32 no further from a float64 run of the reference than the
    float32 reference (2x).  One run's error is a
    noisy quantity for both (at B=3 the float32 reference is sometimes 5x
    luckier than its average), so this single-run check has a floor of 8
    float32 ulps of the value's scale; the systematic comparison is the
    summed accuracy test (the fused error averages 0.8-1.0x the reference's)."""
    if dtype != F32:
        return
    exact = vae_reference(*[a.detach().double() for a in args])
    for name, g, w, e in zip(case.out_names, got, want, exact):
        err_fused = (g.double() - e).abs().max().item() if e.numel() else 0.0
        err_ref = (w.double() - e).abs().max().item() if e.numel() else 0.0
        floor = 2.0**-20 * max(max_abs(e), 1.0)
        assert err_fused <= 2 * err_ref + floor, (
            f"{name}: fused float32 error {err_fused:.3e} vs float32 reference {err_ref:.3e}")


def _vae_module(device):
    module = fused_ops.nn.VAE(784, 256, 32).to(device)
    ref = reference.VAE(784, 256, 32).to(device)
    ref.load_state_dict(module.state_dict())
    return module, ref, (torch.rand(128, 784, device=device), torch.randn(128, 32, device=device))


def _vae_bwd_args(case, size, dtype, device, grads=(True, True, True)):
    args = case.inputs(size, dtype=dtype, device=device)
    ups = tuple(torch.randn(size[0], dtype=dtype, device=device) if g else None for g in grads)
    return (*ups, *args)


def _vae_bad(**changes):
    return arg_modifier(VAE_ARG_NAMES, **changes)


VAE_ELBO = OpCase(
    name="vae_elbo",
    fn=fused_ops.vae_elbo,
    packet=torch.ops.fused_ops.vae_elbo,
    reference=vae_reference,
    make=lambda s, **kw: make_vae_inputs(*s, **kw),
    arg_names=VAE_ARG_NAMES,
    out_names=("elbo", "recon", "kl"),
    out_shapes=lambda s: [(s[0],)] * 3,
    size_id=lambda s: "B{}-I{}-H{}-L{}".format(*s),
    fresh_first=torch.rand_like,
    match_sizes=tuple((B, *shape) for B in (1, 3, 128, 1000)
                      for shape in ((784, 256, 32), (5, 7, 3), (1000, 130, 17), (64, 512, 2))),
    single_run_check=_vae_single_run_check,
    # B=2048 at 784-256-32 runs the 3xTF32 tensor-core paths on CUDA, held to
    # 4x the float32 reference's error: 3xTF32 recovers float32 accuracy up
    # to a small factor, while a product summed over the whole K in the
    # tensor cores' accumulators would miss it by an order of magnitude.  On
    # the CPU that bound is loose.
    accuracy=(Accuracy((128, 784, 256, 32), trials=8), Accuracy((1000, 1000, 130, 17), trials=4),
              Accuracy((2048, 784, 256, 32), trials=3, bound=4)),
    poison_sizes=((1, 5, 7, 3), (129, 784, 256, 32), (2049, 33, 16, 5)),
    poison_numels=lambda s: (s[0],),
    layouts={
        "transposed": (_every(_transposed), "noncontig"),
        "x_row_step": (_per_arg(a0=_row_step), "noncontig"),
    },
    layout_sizes=((40, 21, 10, 3),),
    empty_size=(0, 5, 4, 2),
    opcheck_sizes=((6, 5, 7, 3),),
    meta_size=(11, 5, 7, 3),
    module=_vae_module,
    compile_size=(20, 9, 8, 3),
    compile_loss=lambda o: o[0].sum() + 0.5 * o[1].mean() + o[2].sum(),
    compile_tol=dict(rtol=1e-4, atol=1e-4),
    determinism_sizes=((128, 784, 256, 32), (4100, 784, 256, 32)),
    thread_size=(1000, 100, 64, 8),
    bad_size=(6, 5, 7, 3),
    bad_inputs=(
        Bad("x_1d", _vae_bad(x=lambda t: t[0]), "x", r"2-D"),
        Bad("eps_1d", _vae_bad(eps=lambda t: t[0]), "eps", r"2-D"),
        Bad("eps_rows", _vae_bad(eps=lambda t: t[:5]), "eps", r"\b6\b"),
        Bad("eps_latent", _vae_bad(eps=lambda t: t[:, :2]), "eps", r"\b3\b"),
        Bad("w_enc_3d", _vae_bad(w_enc=lambda t: t[None]), "w_enc", r"2-D"),
        Bad("b_enc_2d", _vae_bad(b_enc=lambda t: t[None]), "b_enc", r"1-D"),
        Bad("w_enc_I", _vae_bad(w_enc=lambda t: t[:, :4]), "w_enc", r"\b5\b"),
        Bad("b_enc_H", _vae_bad(b_enc=lambda t: t[:6]), "b_enc", r"\b7\b"),
        Bad("w_mu_H", _vae_bad(w_mu=lambda t: t[:, :6]), "w_mu", r"\b7\b"),
        Bad("b_mu_L", _vae_bad(b_mu=lambda t: t[:2]), "b_mu", r"\b3\b"),
        Bad("w_logvar_L", _vae_bad(w_logvar=lambda t: t[:2]), "w_logvar", r"\b3\b"),
        Bad("w_logvar_H", _vae_bad(w_logvar=lambda t: t[:, :6]), "w_logvar", r"\b7\b"),
        Bad("b_logvar_L", _vae_bad(b_logvar=lambda t: t[:1]), "b_logvar", r"\b3\b"),
        Bad("w_dec1_H", _vae_bad(w_dec1=lambda t: t[:6]), "w_dec1", r"\b7\b"),
        Bad("w_dec1_L", _vae_bad(w_dec1=lambda t: t[:, :2]), "w_dec1", r"\b3\b"),
        Bad("b_dec1_H", _vae_bad(b_dec1=lambda t: t[:1]), "b_dec1", r"\b7\b"),
        Bad("w_dec2_I", _vae_bad(w_dec2=lambda t: t[:4]), "w_dec2", r"\b5\b"),
        Bad("w_dec2_H", _vae_bad(w_dec2=lambda t: t[:, :6]), "w_dec2", r"\b7\b"),
        Bad("b_dec2_I", _vae_bad(b_dec2=lambda t: t[:4]), "b_dec2", r"\b5\b"),
        Bad("decoder_transposed", _vae_bad(w_dec2=lambda t: t.t().contiguous()), "w_dec2", r"\b5\b"),
        Bad("x_int64", _vae_bad(x=lambda t: t.long()), "x", r"float"),
        Bad("all_float16", _vae_bad(**{n: (lambda t: t.half()) for n in VAE_ARG_NAMES}), "x", r"float"),
        Bad("eps_float64", _vae_bad(eps=lambda t: t.double()), "eps", r"dtype"),
        Bad("w_dec2_float64", _vae_bad(w_dec2=lambda t: t.double()), "w_dec2", r"dtype"),
        Bad("H_0", _vae_bad(w_enc=lambda t: t[:0]), "w_enc", r"H >= 1|at least one"),
        Bad("I_0", _vae_bad(x=lambda t: t[:, :0]), "x", r"I >= 1|at least one"),
    ),
    stream_sizes=((128, 784, 256, 32), (2048, 784, 256, 32)),
    graph_sizes=((128, 784, 256, 32), (2048, 784, 256, 32)),
    cuda_cpu_float64=(((128, 784, 256, 32), 1e-10, 1e-10), ((2048, 784, 256, 32), 1e-10, 1e-10)),
    isa_sizes=((1, 5, 7, 3), (70, 784, 256, 32), (9, 37, 16, 5)),
    # Saturated decoder logits in every fifth column: the BCE loop's clamp.
    isa_prepare="args[11][::5] = 30.0",
    gradcheck_sizes=(((3, 5, 7, 3), False), ((70, 4, 3, 2), True)),  # 70: several CPU row blocks, a partial one
    gradcheck_inputs=vae_gradcheck_inputs,
    gradcheck_tol=dict(eps=1e-6, atol=1e-6, rtol=1e-5),
    gradcheck_alone_size=(3, 5, 7, 3),
    # On CUDA (1000, 784, 256, 32) takes the persistent one-launch backward,
    # (2048, 784, 256, 32) the cuBLAS one (chosen by the number of multiply-adds).
    grad64_sizes=tuple((s, ((0, 1, 2),), {}) for s in
                       ((37, 50, 13, 4), (64, 40, 24, 6), (1000, 784, 256, 32), (2048, 784, 256, 32))),
    grad64_tol=(1e-10, 1e-12),
    grad32_sizes=tuple((s, sub) for s in ((128, 784, 256, 32), (37, 1000, 130, 17))
                       for sub in ((0, 1, 2), (0,), (1,), (2,))),
    grad32_inputs=_vae_grad32_inputs,
    grad32_check=_vae_grad32_check,
    bwd=torch.ops.fused_ops.vae_elbo_backward.default,
    bwd_args=_vae_bwd_args,
    bwd_grad_names=("grad_elbo", "grad_recon", "grad_kl"),
    bwd_upstream_index=0,
    bwd_opcheck_sizes=((6, 5, 7, 3),),
    bwd_opcheck_grads=((True, True, True), (False, True, False), (True, False, False)),
    bwd_meta_size=(11, 5, 7, 3),
    bwd_determinism_sizes=((300, 100, 40, 8),),
    # No bwd_thread_size: the CPU backward's weight gradients are sums over
    # row blocks whose split follows the thread count, so they differ in the
    # last bits between thread counts (bitwise repeatable at a fixed count).
    bwd_bad_size=(4, 6, 5, 3),
    bwd_bad=(
        BwdBad("grad_recon-size", lambda a: (None, torch.ones(5, device=a[3].device), None, *a[3:]),
               r"grad_recon.shape\[0\] must be 4"),
        BwdBad("grad_kl-dtype", lambda a: (None, None, torch.ones(4, dtype=F64, device=a[3].device), *a[3:]),
               "grad_kl must have the same dtype"),
        BwdBad("grad_elbo-rank", lambda a: (torch.ones(4, 1, device=a[3].device), None, None, *a[3:]),
               "grad_elbo must be a 1-D tensor"),
    ),
    bwd_empty_size=(0, 6, 5, 3),
    bwd_linearity_size=(9, 6, 5, 3),
    bwd_stream_size=(1000, 784, 256, 32),
    bwd_graph_size=(128, 784, 256, 32),
    bwd_cuda_cpu_sizes=((37, 50, 13, 4), (1000, 784, 256, 32), (2048, 784, 256, 32)),
    paths=(
        # 3xTF32 tensor-core products: within 4x the float32 reference's
        # error, the bound of the accuracy test at B=2048.
        PathCase("wgmma", (2048, 784, 256, 32), bound=4),
        PathCase("wgmma", (2053, 784, 256, 32), note="partial last row tile, one 16-column tail pass", bound=4),
        PathCase("tiled", (2048, 784, 128, 32), bound=4),
        PathCase("tiled", (2048, 784, 256, 32), note="where the wgmma path would be chosen", bound=4),
        PathCase("cluster", (128, 784, 256, 32), note="8-CTA clusters"),
        PathCase("cluster", (112, 784, 256, 32), note="16-CTA clusters"),
        PathCase("general", (128, 784, 256, 32), F64),
        PathCase("general", (128, 784, 256, 32), note="the general path applies everywhere"),
    ),
    # Every size the CUDA kernels have a reason to treat apart.
    natural=(
        PathCase("cluster", (128, 784, 256, 32), note="one launch, pipelined float4 weight reads, 8-CTA clusters"),
        PathCase("cluster", (112, 784, 256, 32), note="seven row tiles, 16-CTA clusters"),
        PathCase("cluster", (1, 784, 256, 32), note="one partly filled row tile"),
        PathCase("cluster", (37, 1000, 130, 17), note="scalar reads (H, L not multiples of 4)"),
        PathCase("cluster", (300, 5, 7, 3), note="slices smaller than the cluster, many tiles"),
        PathCase("cluster", (128, 64, 512, 2), note="wide hidden layer"),
        PathCase("cluster", (40, 1024, 512, 8), note="wide layers, shared memory above 128 KB"),
        PathCase("cluster", (1000, 64, 128, 8), note="more tiles than resident clusters"),
        PathCase("wgmma", (8192, 784, 256, 32), note="large batch"),
        PathCase("wgmma", (2053, 784, 256, 32), note="partial last row tile, one 16-column tail pass"),
        PathCase("wgmma", (2048, 37, 256, 5), note="I below one chunk, tail passes only, odd L"),
        PathCase("wgmma", (2100, 130, 256, 17), note="one full decoder pass + a 2-column tail"),
        PathCase("wgmma", (2048, 1000, 256, 1), note="L = 1, I not a multiple of 4"),
        PathCase("wgmma", (2048, 256, 256, 32), note="full decoder passes only"),
        PathCase("tiled", (2048, 784, 128, 32)),
        PathCase("tiled", (2048, 100, 64, 8), note="I not a multiple of the column tile"),
        PathCase("tiled", (3000, 37, 40, 5), note="I, H, L odd sizes"),
        PathCase("tiled", (2048, 784, 256, 64), note="wide latent, shared memory above 200 KB"),
        PathCase("general", (64, 4000, 1500, 40), note="activations exceed shared memory"),
        PathCase("general", (128, 784, 256, 32), F64),
        PathCase("general", (2048, 784, 256, 32), F64, note="float64, large batch"),
    ),
    refused=(PathCase("wgmma", (128, 784, 256, 32), F64), PathCase("wgmma", (2048, 784, 128, 32))),
    path_names=("wgmma", "tiled", "cluster", "general"),
    sm90_paths=frozenset({"wgmma", "cluster"}),
    bwd_path_names=("persistent", "cublas"),
    # float64: float32 gradients of these sizes cannot be compared with the
    # reference (ReLU kinks, vae_clear_of_relu_kinks); the paths serve both.
    bwd_paths=(
        PathCase("persistent", (128, 784, 256, 32), F64),
        PathCase("persistent", (1000, 784, 256, 32), F64, note="several tiles per block in most phases"),
        PathCase("cublas", (2048, 784, 256, 32), F64),
        PathCase("cublas", (128, 784, 256, 32), F64, note="the cuBLAS path applies everywhere"),
    ),
    # persistent: B H (6 I + 8 L) <= 1.5e9 multiply-adds, B <= 1181 at 784-256-32.
    bwd_natural=(
        PathCase("persistent", (37, 50, 13, 4), F64), PathCase("persistent", (1181, 784, 256, 32), F64),
        PathCase("cublas", (1182, 784, 256, 32), F64), PathCase("cublas", (2048, 784, 256, 32), F64),
    ),
)


CASES = {c.name: c for c in (IMPORTANCE_SAMPLING, FLOW_EULER, VAE_ELBO)}

# Small sizes for tests of the Python layer (transforms, forward AD) that
# run each op a few times per test.
SMALL_SIZES = {"importance_sampling": (37, 5, 3), "flow_euler": (3, 4, 9, 3), "vae_elbo": (4, 6, 5, 3)}


def small_calls():
    """{op name: (Python function, device -> inputs, extra scalar arguments)} at SMALL_SIZES."""
    out = {}
    for name, size in SMALL_SIZES.items():
        case = CASES[name]
        out[name] = (case.fn, lambda d, case=case, size=size: case.inputs(size, device=d), case.scalars(size))
    return out
