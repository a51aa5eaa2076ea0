"""The scripts in examples/ run (at small sizes, on the CPU; CUDA variants on
a GPU) so that they cannot rot.  Every script there must have a row here."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# script -> (small arguments, a check of its output)
RUNS = {
    "train_vae.py": (["--steps", "12", "--batch", "32", "--sizes", "64", "32", "8"],
                     lambda out: re.search(r"final: ELBO -?\d", out)),
    "sample_flow.py": (["--train-steps", "30", "--samples", "256", "--num-steps", "8"],
                       lambda out: float(re.search(r"max \|fused - reference\| = (\S+)", out).group(1)) < 1e-4),
    "weight_samples.py": (["--samples", "5000"],
                          lambda out: float(re.search(r"max \|weighted - exact\| = (\S+)", out).group(1)) < 0.5),
}
AMP = {"train_vae.py": ["--amp", "--compile"]}


def test_every_example_has_a_run():
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(RUNS)


@pytest.mark.parametrize("amp", [False, True], ids=["plain", "amp"])
@pytest.mark.parametrize("script", sorted(RUNS))
def test_example_runs(script, amp, device, tmp_path):
    if amp and script not in AMP:
        pytest.skip("no autocast variant")
    args, check = RUNS[script]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    cmd = [sys.executable, str(EXAMPLES / script), *args, "--device", device, *(AMP[script] if amp else [])]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    assert check(result.stdout), result.stdout
