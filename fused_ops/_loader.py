"""Loads the compiled extension ``fused_ops._C`` with errors a user can act on."""

import importlib

import torch

_REBUILD = (
    "Rebuild fused_ops against the installed torch: "
    "`pip install --no-build-isolation --force-reinstall --no-deps .` from the source tree "
    "(or install a wheel built for this torch)."
)


def build_info():
    """What the extension was compiled against (written by setup.py)."""
    try:
        from . import _build_info as b
    except ImportError:
        return None
    keys = ("version", "torch_version", "cuda_version", "cuda_arch_list", "with_cuda", "min_torch", "stable_abi")
    return {k: getattr(b, k, None) for k in keys}


def _release(version):
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


def check_compatible(info, torch_version, torch_cuda):
    """Why this build cannot load into the given torch, or None if it can.

    The extension uses only the LibTorch stable ABI, which newer torch
    releases keep: it loads into every torch from ``min_torch`` on.  Its CUDA
    kernels link the CUDA runtime of the major version they were built with.
    """
    built = f"fused_ops was built with torch {info['torch_version']}"
    if _release(torch_version) < _release(info["min_torch"]):
        return (
            f"{built} for the stable ABI of torch >= {info['min_torch']}, but torch "
            f"{torch_version} is installed."
        )
    if info["with_cuda"] and torch_cuda is not None:
        if info["cuda_version"].split(".")[0] != torch_cuda.split(".")[0]:
            return (
                f"{built} and CUDA {info['cuda_version']}, but the installed torch {torch_version} "
                f"uses CUDA {torch_cuda}; the CUDA major versions must match."
            )
    return None


def load_library():
    info = build_info()
    problem = None if info is None else check_compatible(info, torch.__version__, torch.version.cuda)
    if problem:
        raise ImportError(problem + " " + _REBUILD)
    try:
        importlib.import_module("fused_ops._C")
    except ImportError as e:
        built = f" (built for torch {info['torch_version']})" if info else ""
        raise ImportError(
            f"fused_ops._C{built} failed to load with torch {torch.__version__}: {e}. "
            "If it is missing, the package was not compiled (an editable checkout needs "
            "`pip install --no-build-isolation -e .`). " + _REBUILD
        ) from e
