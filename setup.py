"""Build script for fused_ops._C.

CUDA kernels are compiled when a CUDA toolkit is found (or FORCE_CUDA=1);
the CPU kernels are always compiled.  Build with

    pip install --no-build-isolation .

so the extension is compiled against the torch already installed (build
isolation would download a second torch and build against that one).
"""

import glob
import os
import re
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _toolkit_root_from_nvcc(nvcc):
    """The toolkit root for an nvcc on PATH.

    torch guesses CUDA_HOME as two levels above the nvcc it finds.  Some
    machines put a small wrapper script on PATH (``exec /opt/cuda/bin/nvcc``)
    instead of a symlink; follow symlinks and, for a script, the absolute
    ``.../bin/nvcc`` path it names.
    """
    real = os.path.realpath(nvcc)
    candidates = [os.path.dirname(os.path.dirname(real))]
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
        if head.startswith(b"#!"):
            for m in re.finditer(rb"(/[^\s'\"]+)/bin/nvcc\b", head):
                candidates.insert(0, m.group(1).decode())
    except OSError:
        pass
    for root in candidates:
        if os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")) and os.path.isfile(
            os.path.join(root, "bin", "nvcc")
        ):
            return root
    return None


def find_cuda_home():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = _toolkit_root_from_nvcc(nvcc)
        if root:
            return root
    for root in ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True):
        if os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return root
    return None


FORCE_CUDA = os.environ.get("FORCE_CUDA", "0") == "1"
FORCE_CPU = os.environ.get("FORCE_CPU", "0") == "1"
CUDA_HOME = None if FORCE_CPU else find_cuda_home()
if FORCE_CUDA and CUDA_HOME is None:
    sys.exit(
        "FORCE_CUDA=1 but no CUDA toolkit was found (no nvcc on PATH, CUDA_HOME unset, "
        "nothing under /usr/local/cuda*). Install the CUDA toolkit or set CUDA_HOME."
    )
if CUDA_HOME is not None:
    # torch.utils.cpp_extension reads CUDA_HOME once, at import time.
    os.environ["CUDA_HOME"] = CUDA_HOME

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

WITH_CUDA = CUDA_HOME is not None and (FORCE_CUDA or torch.version.cuda is not None)
if FORCE_CUDA and torch.version.cuda is None:
    sys.exit(f"FORCE_CUDA=1 but the installed torch {torch.__version__} is a CPU-only build.")

if WITH_CUDA and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
    # sm_80 and sm_90a machine code; compute_90 PTX (added below) for newer GPUs.
    os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0a"


def cuda_arch_flags():
    """nvcc -gencode flags and macros for TORCH_CUDA_ARCH_LIST.

    The wgmma kernels need sm_90a machine code.  An sm_90a build defines
    FUSED_OPS_SM90A, which lets the host launch them on compute capability
    9.0 -- unless the list also asks for plain sm_90 code: with both in one
    binary the loader's choice between them is not ours, so the build then
    keeps to the sm_80 / sm_90 kernels.  Without any "+PTX" entry, portable
    PTX of the newest listed architecture (compute_90 for the default) is
    added so that newer GPUs can JIT-compile the rest (sm_90a code and its
    PTX run on compute capability 9.0 only).  The flags are all written
    here: torch's build adds none of its own once -gencode flags are given.
    """
    entries = [a.strip() for a in os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";") if a.strip()]
    bases = [a.split("+")[0] for a in entries]  # "9.0a+PTX" -> "9.0a"
    if not all(b.rstrip("a").replace(".", "").isdigit() for b in bases):
        # Named architectures ("Ampere", ...): torch's own flags, no wgmma kernels.
        print(f"fused_ops: TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']!r} has named entries; "
              "torch picks the -gencode flags and the sm_90a (wgmma) kernels are not built")
        return [], []
    flags = []
    for entry, base in zip(entries, bases):
        num = base.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if entry.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    if not any(e.endswith("+PTX") for e in entries):
        newest = max(bases, key=lambda b: float(b.rstrip("a"))).rstrip("a").replace(".", "")
        flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    macros = [("FUSED_OPS_SM90A", None)] if "9.0a" in bases and "9.0" not in bases else []
    return flags, macros


def cuda_library_include_dirs():
    """Headers such as cusparse.h / cublas_v2.h that torch's CUDA headers include.

    torch's pip wheels depend on nvidia-* packages that ship them under
    site-packages/nvidia/<pkg>/include; a bare toolkit may lack them.
    """
    if os.path.isfile(os.path.join(CUDA_HOME, "include", "cusparse.h")):
        return []
    dirs = []
    for site in sys.path:
        for inc in sorted(glob.glob(os.path.join(site, "nvidia", "*", "include"))):
            if os.path.isfile(os.path.join(inc, "cusparse.h")) or os.path.isfile(
                os.path.join(inc, "cublas_v2.h")
            ):
                dirs.append(inc)
    return dirs


# The release; the package version adds a local tag naming the CUDA major.minor
# of a CUDA build (see package_version).
BASE_VERSION = "0.1.0"


def package_version():
    """``BASE_VERSION`` for a CPU-only build, ``BASE_VERSION+cu130`` (the CUDA
    version torch was built with, which the extension's kernels link) for a
    CUDA build, so that the wheel's name says which CUDA it needs.
    ``FUSED_OPS_LOCAL_VERSION`` overrides the tag: empty for none (a CUDA wheel
    for PyPI, which refuses local versions), or any other local tag."""
    local = os.environ.get("FUSED_OPS_LOCAL_VERSION")
    if local is None:
        local = "cu" + torch.version.cuda.replace(".", "") if WITH_CUDA else ""
    if local and not re.fullmatch(r"[A-Za-z0-9]+(\.[A-Za-z0-9]+)*", local):
        sys.exit(f"FUSED_OPS_LOCAL_VERSION={local!r} is not a PEP 440 local version label")
    return BASE_VERSION + ("+" + local if local else "")


def build_info():
    arches = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if WITH_CUDA else ""
    return {
        "version": package_version(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda if WITH_CUDA else None,
        "cuda_arch_list": arches,
        "with_cuda": WITH_CUDA,
        "min_torch": ".".join(map(str, MIN_TORCH)),
        "stable_abi": True,
    }


def write_build_info():
    path = os.path.join(ROOT, "fused_ops", "_build_info.py")
    text = "# Generated by setup.py at build time; do not edit.\n" + "".join(
        f"{k} = {v!r}\n" for k, v in build_info().items()
    )
    with open(path, "w") as f:
        f.write(text)


# The extension is built against the LibTorch stable ABI (torch/csrc/stable)
# and the Python limited API, so one wheel serves every torch release from
# TORCH_TARGET_VERSION on and every CPython from PY_LIMITED_API on.
# pyproject.toml states the same bounds: torch>=2.11 (dependencies and
# build-system requires) and requires-python>=3.10.
MIN_TORCH = (2, 11)
TORCH_TARGET_VERSION = f"0x{MIN_TORCH[0]:02x}{MIN_TORCH[1]:02x}000000000000"
# torch's build_ext defines Py_LIMITED_API for py_limited_api
# extensions (CPython 3.10); the cp310 abi3 tag below says the same.
_TORCH_RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if _TORCH_RELEASE < MIN_TORCH:
    sys.exit(
        f"fused_ops needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} to build (its stable ABI); "
        f"torch {torch.__version__} is installed."
    )


def extensions():
    # Every source under csrc/ is compiled: a new kernel file needs no entry here.
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/**/*.cpp", recursive=True))
    # torch picks the C++ standard.  The CPU kernels parallelise through
    # torch::stable::parallel_for (torch's own thread pool), so no OpenMP here.
    # -fvisibility=hidden: the stable ABI's types are hidden, and nothing but
    # PyInit__C needs to leave the library.
    abi = ["-DTORCH_TARGET_VERSION=" + TORCH_TARGET_VERSION]
    compile_args = {"cxx": ["-O3", "-fvisibility=hidden"] + abi}
    define_macros = []
    extension = CppExtension
    if WITH_CUDA:
        extension = CUDAExtension
        sources += sorted(glob.glob("csrc/cuda/**/*.cu", recursive=True))
        isystem = [f for d in cuda_library_include_dirs() for f in ("-isystem", d)]
        compile_args["cxx"] += isystem
        # No --use_fast_math: expf/logf must stay accurate, the ops are compared
        # with the reference at 1e-4 and against a float64 run of it.
        arch_flags, arch_macros = cuda_arch_flags()
        compile_args["nvcc"] = ["-O3", "-lineinfo", "-Xcompiler", "-fvisibility=hidden"] + abi + isystem + arch_flags
        # USE_CUDA exposes the CUDA part of the stable C shim (current stream).
        define_macros += [("FUSED_OPS_WITH_CUDA", None), ("USE_CUDA", None)] + arch_macros
    return [
        extension(
            "fused_ops._C",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=define_macros,
            extra_compile_args=compile_args,
            py_limited_api=True,
        )
    ]


write_build_info()

setup(
    version=package_version(),
    packages=find_packages(include=["fused_ops", "fused_ops.*"]),
    ext_modules=extensions(),
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
