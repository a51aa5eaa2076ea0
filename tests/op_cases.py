"""The suite's table of ops: one ``OpCase`` per op (defined in op_table/,
one module per op), read by the contract tests (test_contract.py,
test_contract_autograd.py) and the CUDA path tests (test_cuda_paths.py).

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
vae_elbo (B, I, H, L); snis (B, N, D); resample (B, N, M, method); ode_mlp (B, D, H, steps, method, activation);
vae_mlp_elbo (B, I, H1, H2, L, activation, likelihood); importance_log_weights (B, N, D, K, Kq).
Not a test module: pytest collects nothing here.
"""

from op_table.base import (
    BF16,
    F32,
    F64,
    F32_ULP,
    Accuracy,
    Bad,
    BwdBad,
    OpCase,
    PathCase,
    all_subsets,
    as_tuple,
    max_abs,
    subset_id,
)
from op_table.flow_euler import FLOW_EULER
from op_table.importance_sampling import IMPORTANCE_SAMPLING
from op_table.snis import SNIS
from op_table.resample import RESAMPLE
from op_table.ode_mlp import ODE_MLP
from op_table.vae_mlp import VAE_MLP
from op_table.importance_log_weights import IMPORTANCE_LOG_WEIGHTS
from op_table.vae_elbo import (
    VAE_ELBO,
    vae_assert_grads_close,
    vae_clear_of_relu_kinks,
    vae_gradcheck_inputs,
    vae_preactivations,
    vae_reference,
)

__all__ = [
    "CASES", "SMALL_SIZES", "small_calls", "F32", "F64", "F32_ULP", "Accuracy", "Bad", "BwdBad", "OpCase",
    "PathCase", "all_subsets", "as_tuple", "max_abs", "subset_id", "IMPORTANCE_SAMPLING", "FLOW_EULER", "VAE_ELBO", "SNIS", "RESAMPLE",
    "ODE_MLP",
    "VAE_MLP",
    "IMPORTANCE_LOG_WEIGHTS",
    "vae_assert_grads_close", "vae_clear_of_relu_kinks", "vae_gradcheck_inputs", "vae_preactivations",
    "vae_reference",
]

CASES = {c.name: c for c in (IMPORTANCE_SAMPLING, FLOW_EULER, VAE_ELBO, SNIS, RESAMPLE, ODE_MLP, VAE_MLP,
                             IMPORTANCE_LOG_WEIGHTS)}

# Small sizes for tests of the Python layer (transforms, forward AD) that
# run each op a few times per test.
# ode_mlp: 4 steps (the table's grid, spaced 2^-m, is exact in bfloat16 and
# float16 in any case); H = 9 differs from the 8
# midpoint evaluations, or dynamic shapes would tie time_bias' two sizes.
# vae_mlp_elbo: every size distinct, 2L included (B = 2L would tie eps'
# rows to w_head's under dynamic shapes).
SMALL_SIZES = {"importance_sampling": (37, 5, 3), "flow_euler": (3, 4, 9, 3), "vae_elbo": (4, 6, 5, 3), "snis": (3, 37, 4),
               "resample": (3, 37, 5, "stratified"), "ode_mlp": (3, 2, 9, 4, 1, 0),
               "vae_mlp_elbo": (5, 6, 9, 7, 2, 0, 3), "importance_log_weights": (2, 37, 5, 3, 2)}


def small_calls():
    """{op name: (Python function of the table's flat tensors, device -> inputs,
    extra scalar arguments)} at SMALL_SIZES, for the differentiable ops with
    torch.func support."""
    out = {}
    for name, size in SMALL_SIZES.items():
        case = CASES[name]
        if not (case.differentiable and case.func_transforms):
            continue
        n = len(case.arg_names)

        def fn(*a, case=case, size=size, n=n):
            return case.fn(*case.op_args(a[:n], size, a[n:]))

        out[name] = (fn, lambda d, case=case, size=size: case.inputs(size, device=d), case.scalars(size))
    return out
