"""op_cases entry of vae_elbo: sizes (B, I, H, L), and the VAE's helpers
that its own test files share (the differentiable reference, gradcheck and
ReLU-kink input filters, the per-input gradient comparison)."""

from functools import lru_cache

import torch

import fused_ops
from fused_ops import reference
from fused_test_utils import VAE_ARG_NAMES, arg_modifier, make_vae_inputs
from op_table.base import (
    BF16,
    F32,
    F64,
    Accuracy,
    Bad,
    BwdBad,
    OpCase,
    set_arg,
    PathCase,
    every,
    per_arg,
    row_step,
    transposed,
    max_abs,
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
    as well).  A ReLU input within the step of 0 crosses the kink, and a
    target x within the step of 0 or 1 leaves [0, 1], which the CPU kernel
    refuses as binary_cross_entropy does."""
    for _ in range(tries):
        args = case.inputs(size, dtype=F64, device=device)
        pre_enc, pre_dec, logits = vae_preactivations(args)
        x = args[0]
        if (max_abs(logits) <= max_logit
                and min(pre_enc.abs().min().item(), pre_dec.abs().min().item()) >= margin
                and x.min().item() >= margin and x.max().item() <= 1 - margin):
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


def _set(t, index, value):
    """A copy of ``t`` with ``t[index] = value``."""
    t = t.clone()
    t[index] = value
    return t


VAE_ELBO = OpCase(
    name="vae_elbo",
    fn=fused_ops.vae_elbo,
    packet=torch.ops.fused_ops.vae_elbo,
    # The op itself: its autograd is vae_elbo_backward at every size, where
    # fused_ops.vae_elbo takes the training pair at large CUDA batches
    # (test_vae_elbo_grad.py tests that route).
    bwd_fn=torch.ops.fused_ops.vae_elbo,
    reference=vae_reference,
    make=lambda s, **kw: make_vae_inputs(*s, **kw),
    arg_names=VAE_ARG_NAMES,
    out_names=("elbo", "recon", "kl"),
    out_shapes=lambda s: [(s[0],)] * 3,
    size_id=lambda s: "B{}-I{}-H{}-L{}".format(*s),
    fresh_first=torch.rand_like,
    match_sizes=tuple((B, *shape) for B in (1, 3, 128, 1000)
                      for shape in ((784, 256, 32), (5, 7, 3), (1000, 130, 17), (64, 512, 2),
                                  (784, 400, 20))),  # the last: pytorch/examples' VAE
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
        "transposed": (every(transposed), "noncontig"),
        "x_row_step": (per_arg(a0=row_step), "noncontig"),
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
        Bad("all_int32", _vae_bad(**{n: (lambda t: t.int()) for n in VAE_ARG_NAMES}), "x", r"float"),
        Bad("eps_float64", _vae_bad(eps=lambda t: t.double()), "eps", r"dtype"),
        Bad("w_dec2_float64", _vae_bad(w_dec2=lambda t: t.double()), "w_dec2", r"dtype"),
        Bad("H_0", _vae_bad(w_enc=lambda t: t[:0]), "w_enc", r"H >= 1|at least one"),
        Bad("I_0", _vae_bad(x=lambda t: t[:, :0]), "x", r"I >= 1|at least one"),
        # Targets that are not probabilities: binary_cross_entropy raises for
        # them (NaN included), and so does the CPU kernel, naming the first
        # offending element (test_vae_elbo.py: every position, both dtypes,
        # every CPU route).
        *(Bad(f"x_{name}", _vae_bad(x=change), "x", rf"\[0, 1\].*x\[{at}\] = ", cpu_only=True)
          for name, change, at in (
              ("affine", lambda t: t * 3 - 1, r"\d+, \d+"),  # the x*3-1: some below 0, some above 1
              ("above_1", lambda t: _set(t, (0, 0), 1.5), "0, 0"),
              ("negative", lambda t: _set(t, (5, 4), -1e-3), "5, 4"),
              ("huge", lambda t: _set(t, (2, 1), 1e30), "2, 1"),
              ("nan", lambda t: _set(t, (3, 2), float("nan")), "3, 2"),
              ("inf", lambda t: _set(t, (1, 3), float("inf")), "1, 3"),
              ("minus_inf", lambda t: _set(t, (4, 0), float("-inf")), "4, 0"),
          )),
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
        BwdBad("x-None", set_arg(3, lambda a: None), r"x must be a 2-D tensor \[B, I\], got None$"),
        BwdBad("b_dec2-None", set_arg(14, lambda a: None), r"b_dec2 must be a 1-D tensor \[I\], got None$"),
    ),
    bwd_empty_size=(0, 6, 5, 3),
    bwd_linearity_size=(9, 6, 5, 3),
    bwd_stream_size=(1000, 784, 256, 32),
    bwd_graph_size=(128, 784, 256, 32),
    bwd_cuda_cpu_sizes=((37, 50, 13, 4), (1000, 784, 256, 32), (2048, 784, 256, 32)),
    paths=(
        # bfloat16 products with float32 accumulation: within 2x the plain
        # bfloat16 program's error (plus one bfloat16 ulp), as every bfloat16
        # call (test_cuda_paths.py's _check_low_precision).
        PathCase("tiled_bf16", (2085, 784, 256, 32), BF16, note="partial last row tile"),
        PathCase("tiled_bf16", (2048, 100, 64, 7), BF16, note="I below two chunks, L padded to 16"),
        # 3xTF32 tensor-core products: within 4x the float32 reference's
        # error, the bound of the accuracy test at B=2048.
        PathCase("wgmma", (2048, 784, 256, 32), bound=4),
        PathCase("wgmma", (2053, 784, 256, 32), note="partial last row tile, one 16-column tail pass", bound=4),
        PathCase("tiled", (2048, 784, 128, 32), bound=4),
        PathCase("tiled", (2048, 784, 256, 32), note="where the wgmma path would be chosen", bound=4),
        PathCase("cublas", (2048, 784, 400, 20), note="pytorch/examples' widths"),
        PathCase("cublas", (2053, 37, 40, 5), F64, note="float64, odd sizes"),
        PathCase("cublas", (2048, 784, 256, 32), note="where the wgmma path would be chosen"),
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
        PathCase("cluster", (128, 784, 400, 20), note="pytorch/examples' VAE, its batch size"),
        PathCase("cublas", (8192, 784, 400, 20),
                 note="pytorch/examples' VAE at a large batch (H > 256: no tensor-core path)"),
        PathCase("tiled_bf16", (8192, 784, 256, 32), BF16, note="large bfloat16 batch"),
        PathCase("tiled_bf16", (4100, 784, 128, 20), BF16, note="bfloat16, H < 256, L padded to 32"),
        # bfloat16 calls tiled_bf16 does not take: the float32 table on float32 copies.
        PathCase("cluster", (128, 784, 256, 32), BF16, note="bfloat16 below the tensor-core batch"),
        PathCase("tiled", (2048, 784, 248, 32), BF16, note="bfloat16, H % 16 != 0"),
        PathCase("wgmma", (8192, 784, 256, 32), note="large batch"),
        PathCase("wgmma", (2053, 784, 256, 32), note="partial last row tile, one 16-column tail pass"),
        PathCase("wgmma", (2048, 37, 256, 5), note="I below one chunk, tail passes only, odd L"),
        PathCase("wgmma", (2100, 130, 256, 17), note="one full decoder pass + a 2-column tail"),
        PathCase("wgmma", (2048, 1000, 256, 1), note="L = 1, I not a multiple of 4"),
        PathCase("wgmma", (2048, 256, 256, 32), note="full decoder passes only"),
        PathCase("tiled", (2048, 784, 128, 32)),
        PathCase("tiled", (2048, 784, 248, 32), note="H != 256"),
        PathCase("tiled", (2048, 100, 64, 8), note="I not a multiple of the column tile"),
        PathCase("tiled", (3000, 37, 40, 5), note="I, H, L odd sizes"),
        PathCase("tiled", (2048, 784, 256, 64), note="wide latent, shared memory above 200 KB"),
        PathCase("general", (64, 4000, 1500, 40), note="activations exceed shared memory"),
        PathCase("general", (128, 784, 256, 32), F64),
        PathCase("cublas", (2048, 784, 256, 32), F64, note="float64, large batch"),
        PathCase("cublas", (2048, 784, 400, 20), note="H > 256: no tensor-core path"),
    ),
    refused=(PathCase("wgmma", (128, 784, 256, 32), F64), PathCase("wgmma", (2048, 784, 128, 32)),
             PathCase("tiled_bf16", (2048, 784, 256, 32)), PathCase("tiled_bf16", (2048, 784, 248, 32), BF16),
             PathCase("cublas", (2047, 784, 400, 20))),
    path_names=("tiled_bf16", "wgmma", "tiled", "cublas", "cluster", "general"),
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
