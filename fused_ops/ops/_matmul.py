"""``torch.ops.fused_ops._matmul``: the matrix products the kernels run on raw
buffers (csrc/common/matmul.h), as a private op for tests and sanitizer runs.

On CUDA a float32 product goes through the ``matmul`` kernel-path table
(``fused_ops._paths.table("matmul")``): large products on the tensor cores at
float32 accuracy (``tf32x3``), the others on cuBLAS.  ``a [m, k] @ b [k, n]``
with any strides; the result is a new row-major ``[m, n]`` tensor.  No
autograd and no Python function: the ops' own backward kernels call the
products.
"""

import torch

from ._checks import check


@torch.library.register_fake("fused_ops::_matmul")
def _matmul_fake(a, b):
    check(a.dim() == 2 and b.dim() == 2, "a and b must be 2-D")
    check(a.shape[1] == b.shape[0], f"b.shape[0] must be {a.shape[1]} (a.shape[1], the inner size)")
    return a.new_empty((a.shape[0], b.shape[1]))
