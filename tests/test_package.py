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
