"""Where ode_mlp's CUDA forward paths cross over: each path forced, timed over a
grid of batch sizes, widths and depths (D=2, midpoint, 20 steps), beside the
multiply-adds per field evaluation that paths.cuh's stepwise threshold uses.

    python -m tools.ode_path_sweep --out DIR     # CUDA; writes DIR/ode-path-sweep.{md,json}

Times: median us per call (torch.utils.benchmark, blocked_autorange), a path
the table refuses at a size is left blank.
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.utils.benchmark as tb

import fused_ops
from fused_ops import _paths

# split takes only the seed field (D = 64, widths 256, 256, 64): blank on this grid.
PATHS = ("cluster", "tiled", "shared", "general", "stepwise")
BATCHES = (8, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)  # 8, 32: the cluster path's range
LAYOUTS = ((64, 4), (128, 4), (256, 3), (384, 3), (512, 5))  # (width, Linear layers)


def field(D, width, depth, device):
    dims = [D + 1] + [width] * (depth - 1) + [D]  # time as the last input feature
    ws = [torch.randn(o, i, device=device) / i**0.5 for i, o in zip(dims[:-1], dims[1:])]
    bs = [torch.randn(o, device=device) * 0.1 for o in dims[1:]]
    return ws, bs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated paths to force (default: all)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    args = parser.parse_args(argv)
    paths = tuple(args.paths.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    D, steps = 2, 20
    t = torch.linspace(0, 1, steps + 1, device="cuda")
    rows = []
    for width, depth in LAYOUTS:
        ws, bs = field(D, width, depth, "cuda")
        macs = sum(w.numel() for w in ws) - width  # the op folds the time column into a bias
        for B in batches:
            x0 = torch.randn(B, D, device="cuda")
            row = {"width": width, "linear_layers": depth, "B": B, "macs_per_eval": B * macs}
            for path in paths:
                try:
                    with _paths.force("ode_mlp", path), torch.no_grad():
                        fn = lambda: fused_ops.odeint_mlp(x0, t, ws, bs, method="midpoint", activation="silu")  # noqa: E731
                        fn()
                        torch.cuda.synchronize()
                        m = tb.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=args.min_run_time)
                    row[path] = m.median * 1e6
                except RuntimeError:
                    row[path] = None
            with torch.no_grad():
                fused_ops.odeint_mlp(x0, t, ws, bs, method="midpoint", activation="silu")
                natural = _paths.last("ode_mlp")
            row["natural"] = natural
            rows.append(row)
            cells = "  ".join(f"{p} {row[p]:10.1f}" if row[p] else f"{p} {'-':>10}" for p in paths)
            print(f"H={width:4d} L={depth} B={B:6d} macs={B * macs:.2e}  {cells}  natural {natural}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    from bench.report import git_state

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "git_commit": git_state()[0],
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "D": D,
            "steps": steps, "method": "midpoint", "activation": "silu", "dtype": "float32"}
    (args.out / "ode-path-sweep.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# ode_mlp CUDA forward paths, forced: {meta['device']}", "",
             f"torch {meta['torch']}, commit {meta['git_commit']}, {meta['date_utc']}; D=2, midpoint, 20 steps, "
             "SiLU, float32; median us per call.", "",
             "| width | Linear layers | B | multiply-adds per evaluation | " + " | ".join(paths) + " | natural |",
             "|---:|---:|---:|---:|" + "---:|" * len(paths) + "---|"]
    for r in rows:
        cells = " | ".join(f"{r[p]:,.1f}" if r[p] else "-" for p in paths)
        lines.append(f"| {r['width']} | {r['linear_layers']} | {r['B']} | {r['macs_per_eval']:.2e} | {cells} | "
                     f"{r['natural']} |")
    (args.out / "ode-path-sweep.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
