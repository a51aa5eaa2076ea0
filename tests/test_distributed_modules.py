"""tools/multi_gpu.py on two CPU processes (gloo): every fused module
trained under DistributedDataParallel and FSDP2 (``fully_shard``) against
its reference module and against one process on the global batch (the VAE
also under torch.compile, aot_eager backend: the trace without the C++
compile), fused_ops.distributed.snis on uneven shards and with rank 0 holding
none, and the scaling code at small sizes; then the report the script
writes.  The checks themselves are tools/dist_checks.py's: this test is what
keeps the multi-GPU script from rotting between GPU runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from dist_helpers import requires_gloo, run_ranks
from tools import dist_checks, multi_gpu

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "multi_gpu.py"


def _script_rank(rank, world, port, argv):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    rc = multi_gpu.main(argv)
    if rc:
        raise SystemExit(rc)


@requires_gloo
def test_multi_gpu_script_on_two_gloo_ranks(tmp_path, seed):
    argv = ["--backend", "gloo", "--device", "cpu", "--out", str(tmp_path), "--seed", str(seed % 2**62),
            "--compile", "aot_eager", "--compile-models", "VAE", "--snis-log2n", "12", "--snis-d", "2",
            "--vae-batch", "8", "--repeats", "2", "--timeout-s", "60"]
    error = None
    try:
        run_ranks(_script_rank, 2, (argv,), deadline_s=150, what="tools/multi_gpu.py")
    except Exception as e:  # the report below says which check failed; a run without one fails after it
        error = e
    report_file = tmp_path / "multi_gpu_gloo_x2.json"
    assert report_file.exists(), f"no report written; the run ended with {error!r}"
    report = json.loads(report_file.read_text())
    failed = [f"{r['check']}: {r['detail']}\n{r.get('traceback', '')}" for r in report["checks"] if not r["passed"]]
    assert not failed, "\n".join(failed)
    assert error is None, error

    checks = {r["check"]: r for r in report["checks"]}
    want = {f"modules/{m}/{w}" for m in dist_checks.MODELS for w in ("ddp", "fsdp2")}
    want |= {f"modules/VAE/{w}+compile(aot_eager)" for w in ("ddp", "fsdp2")}
    assert want <= set(checks), sorted(want - set(checks))
    for name in want:
        assert checks[name]["ranks"] == [0, 1], name
        assert checks[name]["detail"]["max_param_change"] > 0, name
    snis = [c for c in checks if c.startswith("snis/")]
    assert len(snis) == len(dist_checks.snis_cases(2)) and "shards [0, " in " ".join(snis), snis
    assert checks["devices"].get("skipped"), checks["devices"]

    assert report["passed"] and report["world_size"] == 2 and report["backend"] == "gloo"
    assert report["torch"] == torch.__version__ and report["commit"] and report["date"]
    assert report["environment"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    figure = report["scaling"]
    assert figure["N"] == 2**12 and figure["D"] == 2
    for key in ("dist_snis_ms", "local_snis_ms", "collective_ms", "one_device_snis_ms",
                "vae_ddp_step_reference_ms", "vae_ddp_step_fused_ms"):
        assert figure[key] > 0, key
    md = (tmp_path / "multi_gpu_gloo_x2.md").read_text()
    assert "modules/SNIS/fsdp2 | pass" in md and "Distributed SNIS, N = 2^12" in md


def test_multi_gpu_script_runs_as_a_file():
    # torchrun runs the file itself: its imports resolve from the repository root, its options parse.
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120,
                         cwd="/")
    assert out.returncode == 0, out.stderr
    assert "--backend" in out.stdout and "--snis-log2n" in out.stdout
