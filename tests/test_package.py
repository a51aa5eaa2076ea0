"""Packaging: build metadata, the compatibility check made before loading _C,
and what the stable-ABI build promises (one library for several torch releases)."""

import os
import sys
from pathlib import Path

import pytest
import torch

import fused_ops
from fused_ops._loader import build_info, check_compatible

INFO = {
    "torch_version": "2.14.1+cu130",
    "cuda_version": "13.0",
    "cuda_arch_list": "8.0;9.0a",
    "with_cuda": True,
    "min_torch": "2.11",
    "stable_abi": True,
}


@pytest.mark.parametrize("torch_version", ["2.11.0+cu130", "2.12.0", "2.14.1+cu130", "3.0.0"])
def test_loads_into_any_torch_from_min_torch_on(torch_version):
    assert check_compatible(INFO, torch_version, "13.0") is None


@pytest.mark.parametrize("torch_version", ["2.10.0+cu130", "2.9.1", "1.13.0"])
def test_older_torch_is_refused_with_both_versions_named(torch_version):
    msg = check_compatible(INFO, torch_version, "13.0")
    assert msg is not None
    assert "2.14.1+cu130" in msg and torch_version in msg and ">= 2.11" in msg


def test_cuda_major_mismatch_is_refused():
    msg = check_compatible(INFO, "2.14.1+cu126", "12.6")
    assert msg is not None and "CUDA 13.0" in msg and "12.6" in msg
    assert check_compatible(INFO, "2.14.1+cu131", "13.1") is None  # same major: fine


def test_cpu_build_loads_into_cuda_torch_and_vice_versa():
    cpu_build = dict(INFO, with_cuda=False, cuda_version=None, cuda_arch_list="")
    assert check_compatible(cpu_build, "2.14.1+cu130", "13.0") is None
    assert check_compatible(INFO, "2.14.1+cpu", None) is None


def test_build_info_and_info():
    built = build_info()
    assert built is not None, "setup.py writes fused_ops/_build_info.py"
    assert built["stable_abi"] is True and built["min_torch"] == "2.11"
    info = fused_ops.info()
    assert info["torch"] == torch.__version__
    assert "fused_ops::importance_sampling" in info["ops"]


def test_extension_is_abi3():
    import importlib.util

    origin = importlib.util.find_spec("fused_ops._C").origin
    assert origin.endswith(".abi3.so"), origin


@pytest.mark.skipif(not os.environ.get("FUSED_OPS_TEST_INSTALLED"),
                    reason="set FUSED_OPS_TEST_INSTALLED=1 when testing an installed wheel")
def test_suite_runs_against_the_installed_package():
    # Testing a wheel means every test module imported the installed
    # fused_ops, never the source tree's fused_ops/ next to tests/ (which a
    # sys.path entry for the tree would put first).
    source_tree = Path(__file__).resolve().parents[1]
    assert not Path(fused_ops.__file__).resolve().is_relative_to(source_tree), fused_ops.__file__
    for name, module in sys.modules.items():
        if name == "fused_ops" or name.startswith("fused_ops."):
            where = getattr(module, "__file__", None)
            assert where is None or not Path(where).resolve().is_relative_to(source_tree), (name, where)


def test_version_names_the_cuda_build():
    # 0.1.0 for a CPU-only build, 0.1.0+cu130 for a CUDA 13.0 one (setup.py's
    # package_version; FUSED_OPS_LOCAL_VERSION overrides the tag); an
    # installed wheel's metadata says the same.
    built = build_info()
    if built is None or built.get("version") is None:
        pytest.skip("a library without build metadata (copied in, not built here)")
    assert fused_ops.__version__ == built["version"]
    base, _, local = built["version"].partition("+")
    if "FUSED_OPS_LOCAL_VERSION" not in os.environ:
        assert local == ("cu" + built["cuda_version"].replace(".", "") if built["with_cuda"] else "")
    if os.environ.get("FUSED_OPS_TEST_INSTALLED"):
        import importlib.metadata

        assert importlib.metadata.version("fused_ops") == fused_ops.__version__


def _abi_audit():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "abi_audit.py"
    spec = importlib.util.spec_from_file_location("abi_audit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


needs_binutils = pytest.mark.skipif(
    not all(__import__("shutil").which(t) for t in ("nm", "c++filt", "cc")), reason="needs nm, c++filt and cc")


@needs_binutils
def test_library_imports_only_the_stable_c_shim_from_torch():
    import importlib.util

    stable, other, _ = _abi_audit().audit(importlib.util.find_spec("fused_ops._C").origin)
    assert not other, other
    assert "aoti_torch_library_init_impl" in stable or "torch_library_impl" in stable, stable


@needs_binutils
def test_abi_audit_flags_a_non_stable_symbol(tmp_path):
    # A library that calls one C++ function of libc10 (by its mangled name)
    # and one stable shim function: the audit names the first, demangled.
    import subprocess

    src = tmp_path / "bad.c"
    mangled = "_ZN3c1010ReplaceAllERNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEESt17basic_string_viewIcS3_ES8_"
    src.write_text(f"void {mangled}(void);\nint aoti_torch_abi_version(void);\n"
                   f"int f(void) {{ {mangled}(); return aoti_torch_abi_version(); }}\n")
    lib = tmp_path / "libbad.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    stable, other, _ = _abi_audit().audit(str(lib))
    assert stable == ["aoti_torch_abi_version"]
    assert len(other) == 1 and other[0].startswith("c10::ReplaceAll("), other
