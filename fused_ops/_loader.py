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
    return {k: getattr(b, k) for k in ("torch_version", "cuda_version", "cuda_arch_list", "with_cuda")}


def _release(version):
    return version.split("+")[0].split(".")[:2]


def load_library():
    info = build_info()
    if info is not None and _release(info["torch_version"]) != _release(torch.__version__):
        raise ImportError(
            f"fused_ops._C was built for torch {info['torch_version']} but torch "
            f"{torch.__version__} is installed; the C++ ABI differs between torch releases. "
            + _REBUILD
        )
    try:
        importlib.import_module("fused_ops._C")
    except ImportError as e:
        built = f" (built for torch {info['torch_version']})" if info else ""
        raise ImportError(
            f"fused_ops._C{built} failed to load with torch {torch.__version__}: {e}. "
            "If it is missing, the package was not compiled (an editable checkout needs "
            "`pip install --no-build-isolation -e .`). " + _REBUILD
        ) from e
