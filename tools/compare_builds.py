"""Same-machine A/B timing of two builds of fused_ops (for example the
stable-ABI wheel against a build of the last ATen-API commit).

Each build is a directory that ``import fused_ops`` resolves to when it is
first on PYTHONPATH (a ``pip install --target`` site, or a source tree built
in place).  The driver runs ``python -m bench.benchmark`` once per build per
round, in separate processes, alternating the order every round (A B, B A,
A B, ...) so drift of the machine hits both builds alike, and then reports
for every row the median over rounds of each build's per-call median
(``fused`` and ``eager``; eager does not involve fused_ops and shows the
noise of the machine) and the spread over rounds.

    python -m tools.compare_builds --build stable=/tmp/site_new \\
        --build aten=/tmp/old_tree --rounds 3 --out /tmp/ab -- --ops importance_sampling --no-compile

The benchmark processes run in a temporary directory holding only a copy of
bench/, so no source tree's fused_ops/ shadows the builds.  Writes
``compare-builds.{json,md}`` in --out, next to every round's benchmark output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = ("fused", "eager")


def build_env(path: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    return env


def imported_from(path: str, cwd: Path) -> str:
    """Where ``import fused_ops`` resolves with this build first; it must be inside `path`."""
    out = subprocess.run(
        [sys.executable, "-c", "import fused_ops; print(fused_ops.__file__)"],
        env=build_env(path), cwd=cwd, capture_output=True, text=True, check=True,
    ).stdout.strip()
    if not Path(out).resolve().is_relative_to(Path(path).resolve()):
        raise SystemExit(f"error: with {path} first on PYTHONPATH, fused_ops is imported from {out}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="append", required=True, metavar="LABEL=PATH",
                        help="a build to time (give exactly two)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="after --: arguments for bench.benchmark (not --out)")
    args = parser.parse_args(argv)
    builds = [tuple(b.split("=", 1)) for b in args.build]
    if len(builds) != 2 or any(len(b) != 2 for b in builds):
        parser.error("give exactly two --build LABEL=PATH")
    bench_args = [a for a in args.bench_args if a != "--"]
    cwd = Path(tempfile.mkdtemp(prefix="compare_builds_"))
    shutil.copytree(Path(__file__).resolve().parents[1] / "bench", cwd / "bench",
                    ignore=shutil.ignore_patterns("__pycache__", "results"))
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    origin = {label: imported_from(path, cwd) for label, path in builds}

    # times[label][(workload, size)][variant] -> per-round medians (us)
    times: dict = {label: {} for label, _ in builds}
    shapes: dict = {}
    meta = None
    for r in range(args.rounds):
        for label, path in builds if r % 2 == 0 else builds[::-1]:
            out = args.out / f"{label}-round{r}"
            cmd = [sys.executable, "-m", "bench.benchmark", *bench_args, "--out", str(out)]
            print(f"round {r}: {label}: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, env=build_env(path), cwd=cwd, check=True)
            (result,) = out.glob("*.json")
            data = json.loads(result.read_text())
            meta = meta or data["metadata"]
            for row in data["results"]:
                key = (row["workload"], row["size"])
                shapes[key] = row["shape"]
                for v in VARIANTS:
                    info = row["variants"].get(v, {})
                    if info.get("status") == "ok":
                        times[label].setdefault(key, {}).setdefault(v, []).append(info["median_us"])

    (a, _), (b, _) = builds
    rows = []
    for key in shapes:
        row = {"workload": key[0], "size": key[1], "shape": shapes[key]}
        for label in (a, b):
            for v in VARIANTS:
                runs = times[label].get(key, {}).get(v, [])
                row[f"{label}_{v}_runs_us"] = runs
                row[f"{label}_{v}_us"] = statistics.median(runs) if runs else None
        fa, fb = row[f"{a}_fused_us"], row[f"{b}_fused_us"]
        row[f"{a}_over_{b}"] = fa / fb if fa and fb else None
        rows.append(row)

    doc = {
        "metadata": {
            "device": meta["device"], "torch_version": meta["torch_version"],
            "cuda_version": meta.get("cuda_version"), "python_version": meta["python_version"],
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rounds": args.rounds, "bench_args": bench_args,
            "builds": {label: {"path": path, "fused_ops": origin[label]} for label, path in builds},
        },
        "results": rows,
    }
    (args.out / "compare-builds.json").write_text(json.dumps(doc, indent=1) + "\n")

    def fmt(runs):
        return " / ".join(f"{t:.1f}" for t in runs)

    lines = [
        f"# fused_ops build comparison: {a} vs {b}",
        "",
        f"- device: {meta['device']}; torch {meta['torch_version']}, CUDA {meta.get('cuda_version')}, "
        f"Python {meta['python_version']}",
        f"- date (UTC): {doc['metadata']['date_utc']}; {args.rounds} rounds, order alternating per round; "
        f"benchmark args: `{' '.join(bench_args)}`",
        *(f"- {label}: `{origin[label]}`" for label, _ in builds),
        "- per-call medians in us (`bench.benchmark`, one process per build and round); "
        "the table gives the median over rounds and every round's value",
        "",
        f"| workload | shape | {a} fused | {b} fused | {a}/{b} | {a} rounds | {b} rounds "
        f"| eager ({a} run) | eager ({b} run) |",
        "|---|---|---:|---:|---:|---|---|---:|---:|",
    ]
    for row in rows:
        ratio = row[f"{a}_over_{b}"]
        cells = [row["workload"], row["shape"]]
        cells += [f"{row[f'{lab}_fused_us']:.1f}" if row[f"{lab}_fused_us"] else "-" for lab in (a, b)]
        cells += [f"{ratio:.3f}" if ratio else "-"]
        cells += [fmt(row[f"{lab}_fused_runs_us"]) for lab in (a, b)]
        cells += [f"{row[f'{lab}_eager_us']:.1f}" if row[f"{lab}_eager_us"] else "-" for lab in (a, b)]
        lines.append("| " + " | ".join(cells) + " |")
    (args.out / "compare-builds.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
