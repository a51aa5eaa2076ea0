"""op_cases entry of resample: sizes (B, N, M, method); B None: one problem,
log_weights [N] (else [B, N]).  Not differentiable: the autograd contract
does not apply (``differentiable=False``)."""

import torch

import fused_ops
from fused_ops import reference
from op_table.base import Accuracy, Bad, OpCase, PathCase, per_arg, row_step, transposed

INF = float("inf")


def _lead(size):
    return () if size[0] is None else (size[0],)


def _make(size, dtype=torch.float32, device="cpu", requires_grad=False, zero_every=5):
    """Log weights ~ 2 N(0, 1) with every ``zero_every``-th one -inf (a zero
    weight the indices must never take), and float64 uniforms."""
    _, n, m, method = size
    lw = torch.randn(*_lead(size), n, dtype=torch.float64) * 2
    if zero_every and n > 1:
        lw[..., 1::zero_every] = -INF
    u = torch.rand(*_lead(size), 1 if method == "systematic" else m, dtype=torch.float64)
    lw, u = lw.to(dtype=dtype, device=device), u.to(device)
    return [lw.requires_grad_(requires_grad), u.requires_grad_(requires_grad)]


def _fn(log_weights, uniforms, num_samples, method):
    return fused_ops.resample(log_weights, num_samples, method, uniforms=uniforms)


class _Resampler(torch.nn.Module):
    def __init__(self, fn, num_samples, method):
        super().__init__()
        self.fn, self.num_samples, self.method = fn, num_samples, method

    def forward(self, log_weights, uniforms):
        return self.fn(log_weights, uniforms, self.num_samples, self.method)


def _module(device):
    # Finite log weights (no zero weight): test_mixed_precision.py feeds the
    # module from an nn.Linear, where a -inf input would give NaN.
    size = (8, 3000, 2000, "multinomial")
    return _Resampler(_fn, 2000, "multinomial"), _Resampler(reference.resample, 2000, "multinomial"), tuple(
        _make(size, device=device, zero_every=0))


def _expanded(device):
    # One row of log weights shared by 6 problems (a stride-0 batch dimension).
    size = (6, 500, 300, "stratified")
    lw, u = _make(size, device=device)
    return size, [lw[:1].expand(6, 500), u]


def _invariants(out, args, dtype):
    idx, lw = out[0], args[0]
    assert bool((idx >= 0).all()) and bool((idx < lw.shape[-1]).all())
    assert bool((idx[..., 1:] >= idx[..., :-1]).all()), "indices are ascending"
    assert not torch.isinf(lw.gather(-1, idx)).any(), "an index of zero weight"


def _bad(**changes):
    names = ("log_weights", "uniforms")

    def apply(args):
        return [changes[n](a) if n in changes else a for n, a in zip(names, args)]

    return apply


def _sizes(*sizes):
    return tuple(sizes)


RESAMPLE = OpCase(
    name="resample",
    fn=_fn,
    packet=torch.ops.fused_ops.resample,
    reference=reference.resample,
    make=_make,
    arg_names=("log_weights", "uniforms"),
    float_args=("log_weights",),
    tensor_dims=(0, 1),
    optional_args=("uniforms",),
    out_names=("indices",),
    out_shapes=lambda s: [(*_lead(s), s[2])],
    out_dtypes=lambda dtype: [torch.int64],
    differentiable=False,
    scalars=lambda s: (s[2], s[3]),
    size_id=lambda s: f"B{s[0]}-N{s[1]}-M{s[2]}-{s[3]}",
    match_sizes=_sizes(
        (None, 1, 5, "multinomial"), (None, 1, 5, "systematic"), (None, 7, 3, "stratified"),
        (None, 1000, 1000, "systematic"), (None, 1000, 1000, "stratified"), (None, 1000, 1000, "multinomial"),
        (5, 3, 40, "multinomial"), (17, 1025, 999, "stratified"), (17, 1025, 999, "systematic"),
        (3, 4099, 10000, "multinomial"), (4, 10, 0, "multinomial"), (None, 70001, 50003, "stratified"),
    ),
    # The indices of float32 log weights against those of their float64 values
    # (both searched in a float64 CDF): equal but where a position falls
    # within the float32 rounding of a CDF boundary, as for the reference.
    accuracy=(Accuracy((4, 1000, 1000, "multinomial"), trials=4), Accuracy((None, 5000, 5000, "systematic"))),
    invariants=_invariants,
    poison_sizes=_sizes((None, 1, 1, "systematic"), (7, 300, 257, "stratified"), (3, 5000, 70000, "multinomial")),
    poison_numels=lambda s: (2 * (s[0] or 1) * s[2], (s[0] or 1) * s[2]),
    layouts={
        "transposed": (per_arg(a0=transposed, a1=transposed), "noncontig"),
        "row_step": (per_arg(a0=row_step, a1=row_step), "noncontig"),
    },
    layout_sizes=_sizes((9, 1031, 600, "multinomial"), (9, 1031, 600, "stratified")),
    expanded=_expanded,
    empty_size=(0, 10, 4, "stratified"),
    opcheck_sizes=_sizes((None, 1, 1, "systematic"), (3, 50, 20, "multinomial"), (2, 33, 70, "stratified")),
    meta_size=(4, 11, 6, "stratified"),
    module=_module,
    compile_size=(8, 3000, 2000, "multinomial"),
    determinism_sizes=_sizes((16, 20000, 20000, "multinomial"), (None, 300007, 300007, "systematic")),
    thread_size=(64, 2000, 2000, "multinomial"),
    bad_size=(3, 10, 7, "stratified"),
    bad_inputs=(
        Bad("log_weights_0d", _bad(log_weights=lambda t: t[0, 0]), "log_weights", r"1-D"),
        Bad("log_weights_N0", _bad(log_weights=lambda t: t[:, :0]), "log_weights", r"N >= 1"),
        Bad("log_weights_int64", _bad(log_weights=lambda t: t.long()), "log_weights", r"float32 or float64"),
        Bad("uniforms_1d", _bad(uniforms=lambda t: t[0]), "uniforms", r"2-D"),
        Bad("uniforms_batch", _bad(uniforms=lambda t: t[:2]), "uniforms", r"shape\[0\] must be 3"),
        Bad("uniforms_M", _bad(uniforms=lambda t: t[:, :3]), "uniforms", r"shape\[1\] must be 7"),
        Bad("uniforms_float32", _bad(uniforms=lambda t: t.float()), "uniforms", r"float64"),
        Bad("systematic_takes_one_uniform", _bad(), "uniforms", r"shape\[1\] must be 1", scalars=(7, "systematic")),
        Bad("num_samples_negative", _bad(uniforms=lambda t: t[:, :0]), "num_samples", r">= 0",
            scalars=(-1, "stratified")),
        Bad("method_unknown", _bad(), "method", r"'residual'", scalars=(7, "residual")),
        Bad("all_minus_inf", _bad(log_weights=lambda t: torch.full_like(t, -INF)), "log_weights", r"all -inf",
            cpu_only=True),
        Bad("nan", _bad(log_weights=lambda t: t.index_fill(1, torch.tensor([3]), float("nan"))), "log_weights",
            r"NaN", cpu_only=True),
        Bad("plus_inf", _bad(log_weights=lambda t: t.index_fill(1, torch.tensor([0]), INF)), "log_weights",
            r"\+inf", cpu_only=True),
    ),
    stream_sizes=_sizes((8, 5000, 5000, "multinomial"), (None, 300000, 300000, "systematic")),
    graph_sizes=_sizes((8, 5000, 5000, "multinomial"), (None, 300000, 200000, "stratified")),
    cuda_cpu_float64=(((16, 4099, 4099, "multinomial"), 0, 0), ((None, 300007, 100003, "stratified"), 0, 0)),
    isa_sizes=((5, 1000, 700, "multinomial"), (5, 1000, 700, "systematic")),
    paths=(
        PathCase("multiblock", (2, 70000, 5000, "stratified")),
        PathCase("multiblock", (None, 65537, 300007, "systematic"), note="M > N, a partial last chunk"),
        PathCase("multiblock", (2, 70000, 5000, "multinomial")),
        PathCase("multiblock", (None, 70001, (1 << 22) + 4099, "multinomial"),
                 note="over 2048 chunks of positions: the chunk carries scan in tiles"),
        PathCase("block", (4, 1000, 1000, "multinomial")),
        PathCase("block", (3, 70000, 3000, "multinomial"), note="big N, forced"),
        PathCase("block", (None, 300007, 300007, "systematic"), note="big N, forced"),
    ),
    natural=(
        PathCase("multiblock", (None, 1 << 20, 1 << 20, "systematic")),
        PathCase("block", (64, 4096, 4096, "stratified")),
        PathCase("multiblock", (None, 1 << 20, 1000, "multinomial")),
        PathCase("block", (128, 1 << 16, 100, "multinomial"), note="more problems than multiblock takes"),
    ),
    refused=(PathCase("multiblock", (2, 1000, 100, "multinomial")),),
    path_names=("multiblock", "block"),
)
