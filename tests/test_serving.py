"""Serving: every module of the op table exported (``torch.export``),
compiled and packaged by AOTInductor (``torch._inductor.aoti_compile_and_package``)
into one ``.pt2`` file, then loaded and run in a fresh Python process that
registers the ops either with ``import fused_ops`` or with
``torch.ops.load_library`` of the package's compiled library alone (no
fused_ops Python code).  The outputs equal the eager modules'.

All modules go into one program so that the C++ compile (the slow part on
a small CI machine) runs once per device.  The CUDA variant skips without a GPU.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fused_test_utils import tol
from op_cases import CASES, F32, as_tuple

LIBRARY = importlib.util.find_spec("fused_ops._C").origin

# The child: registers the ops as asked, loads the package, runs it on the
# saved inputs and saves the outputs.  It imports nothing from tests/.
CHILD = textwrap.dedent("""
    import sys, torch
    package, io_path, how = sys.argv[1:4]
    if how == "import":
        import fused_ops  # noqa: F401
    else:
        torch.ops.load_library(how)
        assert "fused_ops" not in sys.modules
    model = torch._inductor.aoti_load_package(package)
    inputs = torch.load(io_path)["inputs"]
    torch.save(list(model(*inputs)), io_path + ".out")
""")


class AllModules(torch.nn.Module):
    """The table's modules side by side: inputs concatenated, outputs too."""

    def __init__(self, modules, counts):
        super().__init__()
        self.parts = torch.nn.ModuleList(modules)
        self.counts = counts

    def forward(self, *inputs):
        outs, at = [], 0
        for module, n in zip(self.parts, self.counts):
            outs.extend(as_tuple(module(*inputs[at:at + n])))
            at += n
        return tuple(outs)


_PACKAGES = {}


def _package(device, tmp_path_factory):
    """(package path, inputs, eager outputs) for ``device``, built once."""
    if device not in _PACKAGES:
        modules, counts, inputs = [], [], []
        for case in CASES.values():
            if case.module is None:
                continue
            module, _, args = case.module(device)
            modules.append(module)
            counts.append(len(args))
            inputs.extend(args)
        model = AllModules(modules, counts).eval()
        with torch.no_grad():
            want = model(*inputs)
            ep = torch.export.export(model, tuple(inputs))
            path = str(tmp_path_factory.mktemp("aoti") / f"fused_ops-{device}.pt2")
            # The wrapper at -O0: the program is one call per op, and the C++
            # compile dominates on a small machine.
            torch._inductor.aoti_compile_and_package(
                ep, package_path=path, inductor_configs={"aot_inductor.compile_wrapper_opt_level": "O0"})
        _PACKAGES[device] = (path, inputs, want)
    return _PACKAGES[device]


@pytest.mark.parametrize("how", ["import", "load_library"])
def test_aoti_package_runs_in_a_fresh_process(how, device, tmp_path, tmp_path_factory):
    path, inputs, want = _package(device, tmp_path_factory)
    io_path = str(tmp_path / "io.pt")
    torch.save({"inputs": inputs}, io_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run(
        [sys.executable, "-c", CHILD, path, io_path, "import" if how == "import" else LIBRARY],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    got = torch.load(io_path + ".out")
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.device == w.device and g.dtype == w.dtype
        torch.testing.assert_close(g, w, **tol(F32))
