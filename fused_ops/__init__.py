"""fused_ops: fused PyTorch C++/CUDA operators for probabilistic ML.

Ops (``torch.ops.fused_ops.*``, also as documented Python functions here and
in :mod:`fused_ops.ops`, one module per op):

- :func:`importance_sampling` -- self-normalised importance sampling with a
  Gaussian-mixture target and a diagonal Gaussian proposal.
- :func:`flow_euler` -- probability-flow ODE sampler: Euler steps of an MLP
  velocity field.
- :func:`vae_elbo` -- VAE forward pass with reparameterisation, BCE
  reconstruction and KL (per-sample ELBO).
- :func:`vae_iwae` -- the K-sample importance-weighted bound of that VAE.
- :func:`vae_mlp_elbo` -- the ELBO of a VAE with MLPs of 1 to 4 hidden
  layers (any widths and activation, one ``[mu | logvar]`` head);
  :func:`vae_mlp_iwae` its K-sample importance-weighted bound.
- :func:`snis` -- self-normalised importance sampling of given log weights
  (batched; normalised weights, ESS, evidence, weighted moments);
  :func:`fused_ops.distributed.snis` across processes.
- :func:`resample` -- multinomial, stratified and systematic resampling of
  log weights to indices.
- :func:`odeint_mlp` (op :func:`ode_mlp`) -- fixed-grid Runge-Kutta sampling
  of an MLP velocity field with torchdiffeq's semantics.
- :func:`importance_log_weights` -- ``log p(x) - log q(x)`` of many problems,
  target and proposal Gaussian mixtures (the batched route of
  :func:`importance_sampling`).

Modules that are drop-in replacements for the reference modules live in
:mod:`fused_ops.nn`; the reference programs themselves in
:mod:`fused_ops.reference`.
"""

from ._loader import build_info as _built_with, load_library as _load_library

_load_library()

from . import _paths  # noqa: E402,F401  (kernel-path debug hook; reads FUSED_OPS_FORCE_PATH)

from . import distributed, nn, ops, reference  # noqa: E402
from .ops import flow_euler, importance_sampling, vae_elbo  # noqa: E402
from .ops import vae_iwae  # noqa: E402
from .ops import vae_mlp_elbo  # noqa: E402
from .ops import vae_mlp_iwae  # noqa: E402
from .ops import snis  # noqa: E402
from .ops import resample  # noqa: E402
from .ops import ode_mlp, odeint_mlp  # noqa: E402
from .ops import importance_log_weights  # noqa: E402

# The package version: 0.1.0, with a local tag naming the CUDA of a CUDA build
# (0.1.0+cu130), as setup.py wrote it into _build_info.
__version__ = (_built_with() or {}).get("version") or "0.1.0"
__all__ = ["importance_sampling", "flow_euler", "vae_elbo", "vae_iwae", "vae_mlp_elbo", "vae_mlp_iwae", "snis", "resample", "ode_mlp", "odeint_mlp", "importance_log_weights", "distributed", "nn", "ops", "reference", "info"]


def info():
    """A dict describing this build: versions, compiled CUDA architectures,
    the devices torch sees, the registered ops and whether the Python
    functions take the fast eager route (:mod:`fused_ops._eager`)."""
    from . import _eager
    from ._loader import build_info

    import torch

    return {
        "fused_ops": __version__,
        "built_with": build_info(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "ops": sorted(
            name for name in torch._C._dispatch_get_all_op_names() if name.startswith("fused_ops::")
        ),
        "eager_route": "fast" if _eager.enabled else "plain torch.ops calls: " + "; ".join(_eager.unavailable),
    }
