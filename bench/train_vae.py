"""Training demo: ``fused_ops.nn.VAE`` and ``fused_ops.reference.VAE`` side by side.

Both models start from the same weights (constructed under one seed), see the
same mini-batches and the same reparameterisation noise ``eps`` at every step
(drawn once per step from a seeded generator and passed as ``eps=``), and are
trained with Adam on ``loss = -elbo.mean()``.  Optionally a third copy runs
``torch.compile`` of the reference's forward + loss (its backward is the
compiled AOTAutograd backward; ``loss.backward()`` and ``optimizer.step()`` are
called eagerly).

The data set is synthetic and needs no download: binarised "digits-like"
``28 x 28`` images (784 features; 64 with ``--input-dim 64``, ``8 x 8``), each
one a few thick strokes drawn from one of ten fixed class templates with
per-image jitter, rendered from a fixed seed (see :func:`make_digits`).

Per step it records the loss of every model and the wall time of the training
step (zero_grad + forward + loss + backward + optimizer step, with a device
synchronisation after it).  It prints the largest relative difference between
the fused and reference loss curves and the time per step; ``--save`` writes
``bench/results/train-vae-<device-slug>.{json,md,png}`` (``--out DIR``: to DIR).

Usage, from the repository root::

    python -m bench.train_vae                      # cuda if available
    python -m bench.train_vae --device cpu --steps 100
    python -m bench.train_vae --device cuda --compile --steps 500 --save
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

BENCH_DIR = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.insert(0, str(BENCH_DIR.parent))

from bench.benchmark import resolve_device, synchronize  # noqa: E402
from bench.report import collect_metadata  # noqa: E402

SEED = 0
DATA_SEED = 1234
EPS_SEED = 4321
REF, FUSED, COMPILE = "reference", "fused", "compile"
COLORS = {REF: "#7f7f7f", COMPILE: "#1f77b4", FUSED: "#d62728"}


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------


def make_digits(num: int, side: int = 28, seed: int = DATA_SEED, num_classes: int = 10,
                strokes: int = 3) -> torch.Tensor:
    """``num`` binarised stroke images ``[num, side * side]`` (float32 0/1), deterministic.

    Each class has ``strokes`` line segments with fixed random endpoints in the
    unit square; an image takes its class's segments, moves every endpoint by
    a little noise, thickens them by a random width and thresholds the
    distance from each pixel centre to the nearest segment.
    """
    gen = torch.Generator().manual_seed(seed)
    templates = torch.rand(num_classes, strokes, 2, 2, generator=gen) * 0.7 + 0.15  # [C, S, end, xy]
    labels = torch.randint(num_classes, (num,), generator=gen)
    ends = templates[labels] + 0.06 * torch.randn(num, strokes, 2, 2, generator=gen)
    width = 0.05 + 0.04 * torch.rand(num, 1, generator=gen)
    coords = (torch.arange(side, dtype=torch.float32) + 0.5) / side
    pix = torch.stack(torch.meshgrid(coords, coords, indexing="ij"), dim=-1).reshape(1, 1, -1, 2)  # [1,1,P,2]
    a, b = ends[:, :, 0:1, :], ends[:, :, 1:2, :]  # [N, S, 1, 2]
    ab = b - a
    t = (((pix - a) * ab).sum(-1) / (ab * ab).sum(-1).clamp_min(1e-6)).clamp(0.0, 1.0)  # [N, S, P]
    dist = (pix - (a + t[..., None] * ab)).norm(dim=-1).amin(dim=1)  # [N, P]
    return (dist < width).to(torch.float32)


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


def make_models(input_dim: int, hidden_dim: int, latent_dim: int, device: torch.device,
                use_compile: bool) -> Dict[str, torch.nn.Module]:
    """The reference and fused VAEs (and a copy for torch.compile) from one initialisation."""
    import fused_ops.nn
    import fused_ops.reference

    torch.manual_seed(SEED)
    reference = fused_ops.reference.VAE(input_dim, hidden_dim, latent_dim)
    torch.manual_seed(SEED)
    fused = fused_ops.nn.VAE(input_dim, hidden_dim, latent_dim)
    # Same seed, same constructor, same parameter creation order: identical weights.
    # (load_state_dict as well, so the demo does not silently depend on that.)
    fused.load_state_dict(reference.state_dict())
    models = {REF: reference.to(device), FUSED: fused.to(device)}
    if use_compile:
        models[COMPILE] = copy.deepcopy(reference)
    return models


def make_step(name: str, model: torch.nn.Module, lr: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One training step ``(x, eps) -> loss`` (detached) for ``model``."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def forward_loss(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        elbo, _, _ = model(x, eps=eps)
        return -elbo.mean()

    loss_fn = torch.compile(forward_loss) if name == COMPILE else forward_loss

    def step(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(x, eps)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def train(args: argparse.Namespace, device: torch.device, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Train every model for ``args.steps`` steps; return losses and step times."""
    side = int(round(math.sqrt(args.input_dim)))
    if side * side != args.input_dim:
        raise SystemExit(f"error: --input-dim must be a square (784, 64, ...), got {args.input_dim}")
    data = make_digits(args.num_images, side=side).to(device)
    models = make_models(args.input_dim, args.hidden_dim, args.latent_dim, device, args.compile)
    steps = {name: make_step(name, model, args.lr) for name, model in models.items()}
    losses: Dict[str, List[float]] = {name: [] for name in models}
    times: Dict[str, List[float]] = {name: [] for name in models}

    batch_gen = torch.Generator().manual_seed(DATA_SEED + 1)
    eps_gen = torch.Generator().manual_seed(EPS_SEED)
    per_epoch = max(1, args.num_images // args.batch)
    order = torch.randperm(args.num_images, generator=batch_gen)
    for step in range(args.steps):
        j = step % per_epoch
        if j == 0 and step:
            order = torch.randperm(args.num_images, generator=batch_gen)
        x = data[order[j * args.batch:(j + 1) * args.batch].to(device)]
        # One eps per step, shared by all models (drawn on the CPU: the same on every device).
        eps = torch.randn(x.shape[0], args.latent_dim, generator=eps_gen).to(device)
        synchronize(device)
        for name, fn in steps.items():
            start = time.perf_counter()
            loss = fn(x, eps)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
            losses[name].append(loss.item())
        if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            log(f"step {step:5d}  " + "  ".join(f"{n} {losses[n][-1]:9.3f}" for n in models))
    return {"losses": losses, "times_s": times}


# ----------------------------------------------------------------------------
# Summary and outputs
# ----------------------------------------------------------------------------


def max_rel_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """``max_i |a_i - b_i| / max(|b_i|, 1e-12)``."""
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)


def summarise(result: Dict[str, Any], warmup_steps: int) -> Dict[str, Any]:
    """Median/mean step time (ms, excluding the first ``warmup_steps``) and curve agreement."""
    summary: Dict[str, Any] = {"warmup_steps_excluded": warmup_steps, "time_per_step_ms": {}}
    for name, ts in result["times_s"].items():
        timed = ts[warmup_steps:] or ts
        summary["time_per_step_ms"][name] = {
            "median": statistics.median(timed) * 1e3,
            "mean": statistics.fmean(timed) * 1e3,
            "min": min(timed) * 1e3,
            "first_step": ts[0] * 1e3,
        }
    ref = result["losses"][REF]
    summary["max_rel_diff_vs_reference"] = {
        name: max_rel_diff(ls, ref) for name, ls in result["losses"].items() if name != REF
    }
    summary["final_loss"] = {name: ls[-1] for name, ls in result["losses"].items()}
    ref_ms = summary["time_per_step_ms"][REF]["median"]
    summary["speedup_vs_reference"] = {
        name: ref_ms / t["median"] for name, t in summary["time_per_step_ms"].items() if name != REF
    }
    return summary


def format_markdown(meta: Dict[str, Any], config: Dict[str, Any], summary: Dict[str, Any]) -> str:
    """Markdown report: settings, the time-per-step table and the loss agreement."""
    lines = [
        f"# VAE training demo: {meta['device']}",
        "",
        f"- device: {meta['device']} ({meta['device_type']}); torch {meta['torch_version']}, "
        f"CUDA {meta['cuda_version']}; {meta['num_threads']} threads of {meta['cpu_count']} cores, "
        f"load average at start {meta['load_avg_1m']:.2f}",
        f"- date (UTC): {meta['date_utc']}; git commit: {meta['git_commit']}"
        + (" (uncommitted changes)" if meta.get("git_dirty") else ""),
        f"- model {config['input_dim']}-{config['hidden_dim']}-{config['latent_dim']}, batch {config['batch']}, "
        f"{config['steps']} Adam steps (lr {config['lr']:g}) on {config['num_images']} synthetic binarised "
        "stroke images; same initial weights, batches and eps for every model",
        "- step = zero_grad + forward + `-elbo.mean()` + backward + Adam step, synchronised; "
        f"median over steps after the first {summary['warmup_steps_excluded']}",
        "- models: `reference` = `fused_ops.reference.VAE`, `fused` = `fused_ops.nn.VAE`"
        + (", `compile` = `torch.compile` of the reference's forward + loss (first step includes compilation)"
           if config.get("compile") else ""),
        "",
        "| model | ms / step (median) | mean | min | first step | x reference | final loss | max rel. diff of loss vs reference |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in summary["time_per_step_ms"].items():
        speed = summary["speedup_vs_reference"].get(name)
        diff = summary["max_rel_diff_vs_reference"].get(name)
        lines.append(
            f"| {name} | {t['median']:.3f} | {t['mean']:.3f} | {t['min']:.3f} | {t['first_step']:.1f} | "
            + (f"{speed:.2f}x" if speed is not None else "1.00x")
            + f" | {summary['final_loss'][name]:.3f} | "
            + (f"{diff:.2e}" if diff is not None else "-")
            + " |"
        )
    return "\n".join(lines) + "\n"


def plot(meta: Dict[str, Any], result: Dict[str, Any], summary: Dict[str, Any], path: Path) -> None:
    """Loss curves (left) and median time per step (right) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for name, ls in result["losses"].items():
        style = {"linestyle": "--", "linewidth": 1.0} if name != REF else {"linewidth": 2.5, "alpha": 0.6}
        ax_loss.plot(range(len(ls)), ls, color=COLORS.get(name), label=name, **style)
    diffs = ", ".join(f"{n}: {d:.1e}" for n, d in summary["max_rel_diff_vs_reference"].items())
    ax_loss.set_title(f"loss = -ELBO mean (max rel. diff vs reference {diffs})", fontsize=8)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (nats / image)")
    ax_loss.set_yscale("log")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)

    names = list(summary["time_per_step_ms"])
    ms = [summary["time_per_step_ms"][n]["median"] for n in names]
    bars = ax_time.bar(names, ms, color=[COLORS.get(n, "#2ca02c") for n in names])
    for bar, value, name in zip(bars, ms, names):
        speed = summary["speedup_vs_reference"].get(name)
        label = f"{value:.3g} ms" + (f"\n{speed:.2f}x" if speed is not None else "")
        ax_time.annotate(label, (bar.get_x() + bar.get_width() / 2, value), xytext=(0, 2),
                         textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax_time.set_ylabel("ms per training step (median)")
    ax_time.set_ylim(0, max(ms) * 1.3)
    ax_time.set_title("time per step (fwd + bwd + Adam)", fontsize=8)
    fig.suptitle(f"VAE training, fused_ops vs reference on {meta['device']} | torch {meta['torch_version']} "
                 f"| {meta['date_utc'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_outputs(meta: Dict[str, Any], config: Dict[str, Any], result: Dict[str, Any],
                  summary: Dict[str, Any], out_dir: Path) -> List[Path]:
    """``train-vae-<slug>.{json,md,png}`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"train-vae-{meta['device_slug']}"
    written = []
    path = stem.with_suffix(".json")
    path.write_text(json.dumps({"metadata": meta, "config": config, "summary": summary,
                                "losses": result["losses"], "times_s": result["times_s"]}, indent=1) + "\n")
    written.append(path)
    path = stem.with_suffix(".md")
    path.write_text(format_markdown(meta, config, summary))
    written.append(path)
    try:
        path = stem.with_suffix(".png")
        plot(meta, result, summary, path)
        written.append(path)
    except Exception as exc:  # noqa: BLE001 - matplotlib missing or failing must not lose the results
        print(f"warning: could not draw the plot: {exc}", file=sys.stderr)
    return written


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (defaults depend on the device: see ``--steps``)."""
    parser = argparse.ArgumentParser(prog="python -m bench.train_vae", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 500 on cuda, 100 on cpu)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--input-dim", type=int, default=784, help="a square: 784 (28x28) or 64 (8x8)")
    parser.add_argument("--hidden-dim", type=int, default=256)
    parser.add_argument("--latent-dim", type=int, default=32)
    parser.add_argument("--num-images", type=int, default=4096, help="size of the synthetic data set")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also train torch.compile(reference forward + loss) (default: on for cuda)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (CPU; default: torch's default). On a loaded "
                             "machine fewer threads than cores avoid OpenMP oversubscription stalls")
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the time statistics")
    parser.add_argument("--log-every", type=int, default=50, help="print losses every N steps (0: never)")
    parser.add_argument("--save", action="store_true",
                        help="write bench/results/train-vae-<device>.{json,md,png} (default: print only)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write the result files to DIR instead")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run the demo; returns ``{"metadata", "config", "summary", "losses", "times_s"}``."""
    args = parse_args(argv)
    device = resolve_device(args.device)
    if args.steps is None:
        args.steps = 500 if device.type == "cuda" else 100
    if args.compile is None:
        args.compile = device.type == "cuda"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import fused_ops  # noqa: F401  (fails early with the loader's message when not built)

    meta_args = argparse.Namespace(no_compile=not args.compile, sizes=None, argv=args.argv)
    meta = collect_metadata(device, meta_args, min_run_time=0.0)
    for key in ("min_run_time_s", "sizes", "timer", "tolerance", "seed"):
        meta.pop(key, None)
    config = {k: getattr(args, k) for k in ("steps", "batch", "input_dim", "hidden_dim", "latent_dim",
                                             "num_images", "lr", "compile", "warmup_steps")}
    config.update(seed=SEED, data_seed=DATA_SEED, eps_seed=EPS_SEED)
    print(f"device: {meta['device']} | torch {meta['torch_version']} | threads {meta['num_threads']} | "
          f"VAE {args.input_dim}-{args.hidden_dim}-{args.latent_dim}, B={args.batch}, {args.steps} steps", flush=True)

    result = train(args, device, log=lambda s: print(s, flush=True))
    summary = summarise(result, min(args.warmup_steps, max(args.steps - 1, 0)))

    print()
    print(format_markdown(meta, config, summary))
    for name, diff in summary["max_rel_diff_vs_reference"].items():
        print(f"max relative difference of the {name} loss curve vs the reference over {args.steps} steps: {diff:.3e}")
    out_dir = args.out if args.out is not None else BENCH_DIR / "results" if args.save else None
    if out_dir is not None:
        for path in write_outputs(meta, config, result, summary, out_dir):
            print(f"wrote {path}")
    return {"metadata": meta, "config": config, "summary": summary, **result}


if __name__ == "__main__":
    main()
