"""Reporting of a benchmark run: the metadata recorded with it (device, torch
and CUDA versions, commit, date), the stdout and markdown tables, and the
JSON / markdown / PNG files written by ``--save`` or ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from bench.workloads import (ATOL, BASE_VARIANTS, FUSED, FUSED_VARIANTS, REPO_ROOT, RTOL, SEED, TABLE_LEGEND, TRAIN_ATOL,
                             TRAIN_LR, TRAIN_RTOL)


def device_name(device: torch.device) -> str:
    """Human-readable device name: the GPU's name, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_slug(device: torch.device) -> str:
    """File stem for the results: ``cpu``, or e.g. ``nvidia-h200`` on CUDA."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-") or "cuda"


def git_state() -> Tuple[Optional[str], Optional[bool]]:
    """``(short commit, working tree dirty)`` of the repository, if available."""
    def git(*args: str) -> Optional[str]:
        try:
            out = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
            )
            return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    if os.environ.get("FUSED_OPS_GIT_COMMIT"):
        # A copy of the tree on a remote GPU machine, whose .git (if any) may
        # not match the files: the caller names the commit it copied.
        return os.environ["FUSED_OPS_GIT_COMMIT"], None
    commit = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (None if status is None else bool(status))


def collect_metadata(device: torch.device, args: argparse.Namespace, min_run_time: float) -> Dict[str, Any]:
    """Environment and run settings recorded with the results."""
    import fused_ops

    commit, dirty = git_state()
    meta: Dict[str, Any] = {
        "device": device_name(device),
        "device_type": device.type,
        "device_slug": device_slug(device),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": dirty,
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fused_ops_version": getattr(fused_ops, "__version__", None),
        "min_run_time_s": min_run_time,
        "compile": not args.no_compile,
        "sizes": args.sizes,
        "timer": "torch.utils.benchmark.Timer.blocked_autorange, median per call",
        "tolerance": {"atol": ATOL, "rtol": RTOL},
        "seed": SEED,
        "argv": list(args.argv),
    }
    if getattr(args, "name", None):
        meta["name"] = args.name
    if getattr(args, "train", False):
        meta["mode"] = "train"
        meta["optimizer"] = args.optimizer
        meta["train_lr"] = TRAIN_LR
        meta["tolerance"] = {"atol": TRAIN_ATOL, "rtol": TRAIN_RTOL}
    if device.type == "cuda":
        meta["device_capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return meta


# ----------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------


def format_us(value: float) -> str:
    """Microseconds with precision that suits the magnitude."""
    if value < 10:
        return f"{value:.2f}"
    if value < 1000:
        return f"{value:.1f}"
    return f"{value:,.0f}"


def ordered_variants(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """All variant names seen in ``rows``: eager, compile variants, peers, fused."""
    seen: List[str] = []
    for row in rows:
        for name in row["variants"]:
            if name not in seen:
                seen.append(name)
    peers = [n for n in seen if n not in BASE_VARIANTS and n not in FUSED_VARIANTS]
    return [n for n in BASE_VARIANTS if n in seen] + peers + [n for n in FUSED_VARIANTS if n in seen]


def variant_cell(row: Dict[str, Any], name: str) -> str:
    """Table cell for one variant: time, ``error``, ``n/a`` or ``-``."""
    res = row["variants"].get(name)
    if res is None:
        return "-"
    if res["status"] == "ok":
        cell = format_us(res["median_us"])
        return cell + " (MISMATCH)" if res.get("match") is False else cell
    return "error" if res["status"] == "error" else "n/a"


def build_table(rows: Sequence[Dict[str, Any]], cuda: bool) -> Tuple[List[str], List[List[str]]]:
    """Headers and cells shared by the stdout and markdown tables."""
    variants = ordered_variants(rows)
    baselines = [n for n in variants if n not in FUSED_VARIANTS]
    headers = ["workload", "size", "shape"] + list(variants)
    headers += [f"x {n}" for n in baselines]
    if cuda:
        headers += ["target", "fused/target"]
    cells = []
    for row in rows:
        line = [row["workload"], row["size"], row["shape"]]
        if "error" in row:
            line += ["error"] * (len(variants) + len(baselines))
        else:
            line += [variant_cell(row, n) for n in variants]
            for n in baselines:
                ratio = row["speedup"].get(n)
                line.append(f"{ratio:.2f}x" if ratio is not None else "-")
        if cuda and "speedup_targets" in row:
            line.append(", ".join(f">={v:g}x {k}" for k, v in row["speedup_targets"].items()))
            met = row.get("meets_target")
            misses = ", ".join(row["target_misses"])
            line.append(f"n/a ({misses})" if met is None else "met" if met else f"missed ({misses})")
        elif cuda:
            target = row.get("target_us")
            line.append(f"{target:g}" if target is not None else "-")
            over = row.get("fused_over_target")
            line.append("-" if over is None else f"{over:.2f} ({'met' if over <= 1 else 'missed'})")
        cells.append(line)
    return headers, cells


def format_text_table(headers: List[str], cells: List[List[str]]) -> str:
    """Plain aligned table for stdout."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)] if cells else [
        len(h) for h in headers
    ]
    left = {0, 1, 2}

    def fmt(line: List[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))

    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(c) for c in cells])


def format_markdown(meta: Dict[str, Any], rows: Sequence[Dict[str, Any]]) -> str:
    """The markdown report: metadata header, the table, then notes."""
    headers, cells = build_table(rows, meta["device_type"] == "cuda")
    commit = meta["git_commit"] or "unknown"
    if meta.get("git_dirty"):
        commit += " (uncommitted changes)"
    train = meta.get("mode") == "train"
    if train:
        timing = (
            f"- timing: back-to-back training steps (grads set to None, forward + loss, backward"
            + ("" if meta.get("optimizer", "none") == "none" else f", {meta['optimizer']} step")
            + f"), `blocked_autorange(min_run_time={meta['min_run_time_s']:g})`, after warm-up;"
            " `compile*` compile forward + loss (backward compiled by AOTAutograd); `fused` is eager"
            " (no CUDA graph), `fused_compile_ro` the fused module's forward + loss under"
            " torch.compile(mode=\"reduce-overhead\") (CUDA graphs of forward and backward)"
        )
        checked = f"first-step loss and parameter gradients checked against eager with atol = rtol = {TRAIN_ATOL:g}"
    else:
        timing = (
            f"- timing: back-to-back calls, `blocked_autorange(min_run_time={meta['min_run_time_s']:g})`,"
            " under `torch.no_grad()`, after warm-up; `fused` is an eager call (no CUDA graph),"
            " `fused_compile_ro` the fused module under torch.compile(mode=\"reduce-overhead\")"
        )
        checked = f"outputs checked against eager with atol = rtol = {ATOL:g}"
    lines = [
        f"# fused_ops {'training-step ' if train else ''}benchmark: {meta['device']}",
        "",
        f"- device: {meta['device']} ({meta['device_type']}"
        + (f", compute capability {meta['device_capability']}" if "device_capability" in meta else "")
        + ")",
        f"- torch {meta['torch_version']}, CUDA {meta['cuda_version']}, Python {meta['python_version']}",
        f"- date (UTC): {meta['date_utc']}",
        f"- git commit: {commit}",
        f"- CPU threads: {meta['num_threads']} of {meta['cpu_count']} cores; load average at start: "
        + (f"{meta['load_avg_1m']:.2f}" if meta["load_avg_1m"] is not None else "n/a")
        + f"; float32 matmul precision: {meta['float32_matmul_precision']}",
        timing,
        f"- {TABLE_LEGEND}; {checked}",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i < 3 else "---:" for i in range(len(headers))) + "|",
    ]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    if meta["device_type"] == "cuda" and train:
        lines += ["", "Targets: issue 5 (H200), minimum speed-up of the fused training step over the named "
                  "baseline (VAE rows only)."]
    elif meta["device_type"] == "cuda":
        lines += ["", "Targets: DESIGN.md section 7 (H200)."]
    paths = [f"- {row['workload']}/{row['size']}: "
             + ", ".join(f"{op} `{path}`" for op, path in row["variants"][FUSED]["kernel_paths"].items())
             for row in rows if "kernel_paths" in row["variants"].get(FUSED, {})]
    if paths:
        lines += ["", "Kernel paths taken by the fused calls (`fused_ops._paths`):", ""] + paths
    bandwidth = [f"- {row['workload']}/{row['size']}: {row['fused_gb_per_s']:.3g} GB/s"
                 for row in rows if "fused_gb_per_s" in row]
    if bandwidth:
        lines += ["", "Bandwidth of the fused calls (the bytes they must move / median time):", ""] + bandwidth
    notes = []
    for row in rows:
        for name, res in row["variants"].items():
            if res["status"] == "error":
                notes.append(f"- {row['workload']}/{row['size']} {name}: error: {res['error'].splitlines()[0]}")
            elif res.get("match") is False:
                notes.append(f"- {row['workload']}/{row['size']} {name}: output mismatch ({res['mismatch']})")
        if "error" in row:
            notes.append(f"- {row['workload']}/{row['size']}: {row['error']}")
    if notes:
        lines += ["", "Problems:", ""] + notes
    return "\n".join(lines) + "\n"


def write_outputs(meta: Dict[str, Any], rows: List[Dict[str, Any]], out_dir: Path, plot: bool = True) -> List[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and (with matplotlib and ``plot``) ``<stem>.png``;
    ``<stem>`` is the device slug, plus ``-train`` for training rows, plus ``-<name>``
    for a run given ``--name``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / (meta["device_slug"] + ("-train" if meta.get("mode") == "train" else "")
                      + (f"-{meta['name']}" if meta.get("name") else ""))
    data = {"metadata": meta, "results": rows}
    written = []
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    written.append(json_path)
    md_path = stem.with_suffix(".md")
    md_path.write_text(format_markdown(meta, rows))
    written.append(md_path)

    if not plot:
        return written
    try:
        from bench.plot import plot_results
    except ImportError as exc:  # matplotlib missing
        print(f"warning: not drawing the chart ({exc})", file=sys.stderr)
    else:
        png_path = stem.with_suffix(".png")
        try:
            plot_results(data, png_path)
            written.append(png_path)
        except Exception as exc:  # noqa: BLE001 - a plotting problem must not lose the results
            print(f"warning: could not draw {png_path}: {exc}", file=sys.stderr)
    return written

