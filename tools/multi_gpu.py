"""fused_ops on several GPUs of one host: correctness checks and the scaling
figure, one process per GPU under torchrun (NCCL).

    torchrun --nproc-per-node=2 tools/multi_gpu.py --out bench/results/multi-gpu

from the repository root, fused_ops built (or installed) with CUDA; pytest
must be importable (the device checks take their inputs from the test
suite's op table, tests/op_cases.py).  NVLink multicast stays off: the script
sets ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` in its
environment before the process group starts (and records them).  Checks (``--checks``):

- ``modules``: each fused module (tools/dist_checks.MODELS: VAE, FlowODE,
  ODESampler, ImportanceSampler, SNIS) trained for ``--steps`` SGD steps
  under DDP, DDP + torch.compile (``--compile``) and FSDP2 (``fully_shard``)
  against the reference module under the same wrapper on the same per-rank
  data, and against one process on the global batch: losses and parameters
  agree within float32 tolerance.
- ``snis``: fused_ops.distributed.snis on shards of one sample set (uneven
  shards, rank 0 without samples) against fused_ops.snis on the
  concatenation: values and gradients.
- ``devices`` (two or more GPUs; rank 0): every op of the op table called on
  cuda:1 with cuda:0 current, and on a side stream of cuda:1 behind a delayed
  producer of its input in NaN-poisoned memory: outputs bitwise the
  default-stream call on cuda:0.
- ``scaling``: distributed SNIS of ``2**--snis-log2n`` float32 log weights
  (``--snis-d`` sample dimensions) over the world against fused_ops.snis of
  all of them on one GPU: the median time per call (CUDA events, ``--repeats``
  calls) and the share of it spent in the collective (an all_gather of the
  partials timed alone); a DDP training step (Adam) of the fused VAE
  784-256-32 against the reference at ``--vae-batch`` samples per GPU.

Writes ``multi_gpu_<backend>_x<world>.{json,md}`` into ``--out`` (device,
torch and fused_ops versions, commit, date, world size, every check and
figure) and exits non-zero on any mismatch.  ``--backend gloo --device cpu``
runs the same checks on CPU processes (``devices`` is skipped there; the
scaling code runs at whatever sizes are given, timed by the host clock):
what the CI test (tests/test_distributed_modules.py) runs.
"""

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: the tools package and an in-place fused_ops (an installed one wins)
    sys.path.append(str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fused_ops  # noqa: E402
import fused_ops.distributed as fd  # noqa: E402
from tools import dist_checks  # noqa: E402

CHECKS = ("modules", "snis", "devices", "scaling")
# NVLink multicast off (NVLS in NCCL, multicast in symmetric memory): set before the process group starts.
ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the JSON and markdown summary")
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--models", default=",".join(dist_checks.MODELS), help="modules the 'modules' check trains")
    p.add_argument("--wrappers", default="ddp,fsdp2", help="ddp, fsdp2 (each also compiled when --compile is set)")
    p.add_argument("--compile", default="inductor", help="torch.compile backend of the compiled runs ('' for none)")
    p.add_argument("--compile-models", default=",".join(dist_checks.MODELS), help="modules also trained compiled")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seed of the models' initial parameters and of the data")
    p.add_argument("--snis-log2n", type=int, default=28)
    p.add_argument("--snis-d", type=int, default=0)
    p.add_argument("--vae-batch", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--timeout-s", type=int, default=600, help="process-group timeout of a collective")
    args = p.parse_args(argv)
    args.checks = [c for c in args.checks.split(",") if c]
    bad = sorted(set(args.checks) - set(CHECKS))
    if bad:
        p.error(f"--checks: unknown {bad}; choose from {list(CHECKS)}")
    args.models = [m for m in args.models.split(",") if m]
    args.wrappers = [w for w in args.wrappers.split(",") if w]
    args.compile_models = [m for m in args.compile_models.split(",") if m]
    if (set(args.models) | set(args.compile_models)) - set(dist_checks.MODELS) or set(args.wrappers) - {"ddp", "fsdp2"}:
        p.error(f"--models and --compile-models from {list(dist_checks.MODELS)}, --wrappers from ['ddp', 'fsdp2']")
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    return args


def _commit():
    if os.environ.get("FUSED_OPS_COMMIT"):
        return os.environ["FUSED_OPS_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        return head.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _run(results, name, fn, *a, **kw):
    """Runs one check, recording it as passed (with what fn returns) or
    failed (with the error); collectives inside fn come before its asserts,
    so a failure on one rank leaves the others in step."""
    try:
        results.append({"check": name, "passed": True, "detail": fn(*a, **kw)})
    except Exception as e:  # noqa: BLE001  (the report names it; the exit status fails the run)
        results.append({"check": name, "passed": False, "detail": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc(limit=-4)})


def check_modules(args, device, results):
    for model in args.models:
        for how in args.wrappers:
            for backend in ([None, args.compile] if args.compile and model in args.compile_models else [None]):
                label = f"modules/{model}/{how}" + (f"+compile({backend})" if backend else "")
                _run(results, label, dist_checks.check_module, model, how, device, steps=args.steps,
                     compile_backend=backend, seed=args.seed)


def check_snis(args, device, results):
    for k, case in enumerate(dist_checks.snis_cases(dist.get_world_size())):
        sizes, batch, d, moments, with_samples, dtype = case
        label = f"snis/{k}: shards {sizes}, batch {list(batch)}, D={d if with_samples else 0}, " \
                f"moments={moments}, {str(dtype).removeprefix('torch.')}"
        _run(results, label, dist_checks.check_snis, *case, device=device, seed=args.seed)


def check_devices(results):
    """Rank 0: every op of the op table on cuda:1 with cuda:0 current, then on
    a side stream of cuda:1 (see the module docstring)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import op_cases  # noqa: E402  (the suite's op table: inputs, calls)
    from fused_test_utils import poison_allocator  # noqa: E402

    for name, case in op_cases.CASES.items():
        def one(case=case):
            size = case.stream_sizes[0]
            args0 = case.inputs(size, device="cuda:0")
            want = [t.cpu() for t in case.fused(args0, size)]
            args1 = [a.to("cuda:1") for a in args0]
            torch.cuda.synchronize(1)
            with torch.cuda.device(0):
                out = case.fused(args1, size)
            assert all(t.device == torch.device("cuda:1") for t in out), "outputs not on cuda:1"
            torch.cuda.synchronize(1)
            for n, a, b in zip(case.out_names, out, want):
                assert torch.equal(a.cpu(), b), f"{n} on cuda:1 (cuda:0 current) differs from cuda:0's"
            side = torch.cuda.Stream(device="cuda:1")
            with torch.cuda.stream(side):
                poison_allocator("cuda:1", torch.float32, [args1[0].numel(), *(t.numel() for t in out)])
                torch.cuda.synchronize(1)
                torch.cuda._sleep(50_000_000)
                first = args1[0] * 1.0  # produced on the side stream, after the delay
                with torch.cuda.device(0):
                    out = case.fused([first, *args1[1:]], size)
            side.synchronize()
            for n, a, b in zip(case.out_names, out, want):
                assert torch.equal(a.cpu(), b), f"{n} on a side stream of cuda:1 differs from cuda:0's default stream"
            return {"size": list(size) if isinstance(size, tuple) else size}
        _run(results, f"devices/{name}", one)


def _median_ms(fn, device, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def scaling(args, device):
    """The figures (module docstring): per-rank medians, the slowest rank's
    kept; the one-device baseline runs on rank 0 while the others wait."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n, d = 2 ** args.snis_log2n, args.snis_d
    n_r = n // world + (rank < n % world)
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    lw = torch.randn(n_r, generator=g, device=device) * 3
    x = torch.randn(n_r, d, generator=g, device=device) if d else None
    part = torch.zeros(world * (3 + 2 * d), dtype=torch.float64, device=device)
    mine = {
        "dist_snis_ms": _median_ms(lambda: fd.snis(lw, x, moments=bool(d)), device, args.repeats),
        "local_snis_ms": _median_ms(lambda: fused_ops.snis(lw, x, bool(d)), device, args.repeats),
        "collective_ms": _median_ms(lambda: fd._gather(part[:3 + 2 * d], None), device, args.repeats),
    }
    del lw, x
    vae = {}
    for label, make in (("reference", lambda: dist_checks.reference.VAE(784, 256, 32)),
                        ("fused", lambda: dist_checks.fnn.VAE(784, 256, 32))):
        torch.manual_seed(0)
        model = make().to(device)
        ddp = dist_checks._wrap(model, "ddp", device, None)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        xb = torch.rand(args.vae_batch, 784, device=device)

        def step(ddp=ddp, opt=opt, xb=xb):
            loss = -ddp(xb)[0].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        vae[f"vae_ddp_step_{label}_ms"] = _median_ms(step, device, args.repeats)
    mine.update(vae)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    figure = {k: max(r[k] for r in everyone) for k in mine}
    if rank == 0:
        full = torch.randn(n, device=device) * 3
        xf = torch.randn(n, d, device=device) if d else None
        figure["one_device_snis_ms"] = _median_ms(lambda: fused_ops.snis(full, xf, bool(d)), device, args.repeats)
        del full, xf
    dist.barrier()
    figure.update(N=n, D=d, vae_batch_per_rank=args.vae_batch, repeats=args.repeats)
    return figure


def _markdown(report):
    lines = [f"# fused_ops on {report['world_size']} x {report['device']} ({report['backend']})", "",
             f"torch {report['torch']}, fused_ops {report['fused_ops']}, commit {report['commit']}, "
             f"{report['date']}; environment {report['environment']}", "",
             "| check | result | detail |", "|---|---|---|"]
    for r in report["checks"]:
        detail = json.dumps(r["detail"]) if not isinstance(r["detail"], str) else r["detail"]
        result = "skip" if r.get("skipped") else "pass" if r["passed"] else "**FAIL**"
        lines.append(f"| {r['check']} | {result} | {detail.replace('|', '/')} |")
    s = report.get("scaling")
    if s:
        share = s["collective_ms"] / s["dist_snis_ms"]
        lines += ["", f"## Distributed SNIS, N = 2^{int(math.log2(s['N']))}, D = {s['D']}, float32, "
                  f"median of {s['repeats']} calls", "",
                  "| | ms per call |", "|---|---|",
                  f"| one device, fused_ops.snis of all N | {s.get('one_device_snis_ms', float('nan')):.4f} |",
                  f"| {report['world_size']} ranks, fused_ops.distributed.snis (slowest rank) "
                  f"| {s['dist_snis_ms']:.4f} |",
                  f"| of which the local fused_ops.snis of the shard | {s['local_snis_ms']:.4f} |",
                  f"| of which the all_gather of the partials (timed alone) | {s['collective_ms']:.4f} "
                  f"({100 * share:.1f}% of the call) |", "",
                  f"## DDP training step (Adam) of the VAE 784-256-32, B = {s['vae_batch_per_rank']} per rank", "",
                  "| module | ms per step |", "|---|---|",
                  f"| reference | {s['vae_ddp_step_reference_ms']:.4f} |",
                  f"| fused | {s['vae_ddp_step_fused_ms']:.4f} |"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    os.environ.update(ENVIRONMENT)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        results, figure = [], None
        if "modules" in args.checks:
            check_modules(args, device, results)
        if "snis" in args.checks:
            check_snis(args, device, results)
        if "devices" in args.checks:
            if device.type != "cuda" or torch.cuda.device_count() < 2:
                results.append({"check": "devices", "passed": True, "skipped": True,
                                "detail": "skipped: needs two CUDA devices"})
            elif rank == 0:
                check_devices(results)
            dist.barrier()
        if "scaling" in args.checks:
            figure = scaling(args, device)
        everyone = [None] * world
        dist.all_gather_object(everyone, results)
        merged = {}  # by check, in the order of first appearance; failed if it failed on any rank
        for q, rank_results in enumerate(everyone):
            for r in rank_results:
                seen = merged.setdefault(r["check"], dict(r, ranks=[]))
                seen["ranks"].append(q)
                if not r["passed"]:
                    failed = seen.get("failed_on_ranks", [])
                    if seen["passed"]:
                        seen.update(r)
                    seen["failed_on_ranks"] = failed + [q]
        merged = list(merged.values())
        ok = all(r["passed"] for r in merged)
        if rank == 0:
            report = {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "backend": args.backend, "world_size": world, "torch": torch.__version__,
                "fused_ops": fused_ops.__version__, "commit": _commit(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "environment": {k: os.environ.get(k) for k in ENVIRONMENT},
                "argv": sys.argv[1:] if argv is None else list(argv), "passed": ok, "checks": merged,
                "scaling": figure,
            }
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            stem = out / f"multi_gpu_{args.backend}_x{world}"
            stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
            stem.with_suffix(".md").write_text(_markdown(report))
            for r in merged:
                if not r["passed"]:
                    print(f"FAIL {r['check']}: {r['detail']}\n{r.get('traceback', '')}", file=sys.stderr)
            print(f"{'passed' if ok else 'FAILED'}: {sum(r['passed'] for r in merged)}/{len(merged)} checks; "
                  f"{stem}.json, {stem}.md")
        # Tear the group down together: a gloo rank whose peer has already
        # destroyed its group can abort at exit.
        dist.barrier()
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
