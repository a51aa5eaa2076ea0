"""``torch.ops.fused_ops._matmul``: the matrix products the kernels run on raw
buffers (csrc/common/matmul.h), as a private op for tests and sanitizer runs.

On CUDA a float32 product goes through the ``matmul`` kernel-path table
(``fused_ops._paths.table("matmul")``): large products on the tensor cores at
float32 accuracy (``tf32x3``), the others on cuBLAS.  ``a [m, k] @ b [k, n]``
with any strides; the result is a new row-major ``[m, n]`` tensor.
``torch.ops.fused_ops._linear_act(a, w, bias, row_bias, act, act_param,
in_place)`` (CUDA float32) is a hidden layer on the same table: ``out = a @
w.T + bias (+ row_bias)`` and ``h = act(out)`` computed in the product's
epilogue (``act`` an activation code, < 0 for none; ``in_place``: ``out``
holds ``act(out)`` and ``h`` is empty).  No autograd and no Python
functions: the ops' own kernels call the products.
"""

import torch

from ._checks import check


@torch.library.register_fake("fused_ops::_matmul")
def _matmul_fake(a, b):
    check(a.dim() == 2 and b.dim() == 2, "a and b must be 2-D")
    check(a.shape[1] == b.shape[0], f"b.shape[0] must be {a.shape[1]} (a.shape[1], the inner size)")
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.register_fake("fused_ops::_linear_act")
def _linear_act_fake(a, w, bias, row_bias, act, act_param, in_place):
    check(a.dim() == 2 and w.dim() == 2, "a and w must be 2-D")
    check(a.shape[1] == w.shape[1], f"w.shape[1] must be {a.shape[1]} (a.shape[1], the inner size)")
    separate = act >= 0 and not in_place
    m, n = a.shape[0], w.shape[0]
    return [a.new_empty((m, n)), a.new_empty((m, n) if separate else (0, 0))]
