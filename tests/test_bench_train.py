"""The training demo (bench/train_vae.py) and the benchmark's training-step rows, on CPU, tiny sizes."""

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

# bench/ is not installed: import it from the source tree, appended (not
# prepended) so that the fused_ops under test stays the one found first (an
# installed wheel must not be shadowed by the source tree's fused_ops/).
sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench import benchmark, train_vae  # noqa: E402

@pytest.fixture(autouse=True)
def one_thread():
    """Tiny problems on one thread: on a loaded 2-core machine two OpenMP
    threads can make a tiny step 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY_DEMO = ["--device", "cpu", "--steps", "3", "--batch", "16", "--input-dim", "64", "--hidden-dim", "32",
             "--latent-dim", "8", "--num-images", "64", "--no-compile", "--warmup-steps", "1", "--log-every", "0"]


def test_make_digits_is_deterministic_binary_and_varied():
    a = train_vae.make_digits(32, side=8)
    b = train_vae.make_digits(32, side=8)
    assert a.shape == (32, 64) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert set(a.unique().tolist()) <= {0.0, 1.0}
    # Neither blank nor full, and not all the same image.
    assert 0.05 < a.mean().item() < 0.95
    assert len({tuple(row.tolist()) for row in a}) > 16


def test_train_demo_fused_and_reference_losses_agree(tmp_path):
    out = train_vae.main(TINY_DEMO + ["--out", str(tmp_path)])
    losses = out["losses"]
    assert set(losses) == {"reference", "fused"}
    ref, fused = losses["reference"], losses["fused"]
    assert len(ref) == len(fused) == 3
    assert all(math.isfinite(v) for v in ref + fused)
    # Same initial weights, batches and eps: the curves agree (and training moves the loss).
    assert fused[0] == pytest.approx(ref[0], rel=1e-5)
    assert out["summary"]["max_rel_diff_vs_reference"]["fused"] < 1e-4
    assert ref[-1] != ref[0]
    for name in ("reference", "fused"):
        assert len(out["times_s"][name]) == 3 and all(t > 0 for t in out["times_s"][name])
    # The chart needs matplotlib (the "bench" extra), which the test set-up does not install.
    charts = ("png",) if importlib.util.find_spec("matplotlib") else ()
    for suffix in ("json", "md", *charts):
        assert (tmp_path / f"train-vae-cpu.{suffix}").is_file()
    assert "max rel. diff" in (tmp_path / "train-vae-cpu.md").read_text()


def test_max_rel_diff_detects_a_difference():
    assert train_vae.max_rel_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert train_vae.max_rel_diff([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)


TINY_SIZES = {
    "importance_sampling": {"N": 64, "D": 4, "K": 2},
    "flow": {"B": 4, "D": 8, "steps": 3},
    "vae": {"B": 8, "I": 16, "H": 8, "L": 4},
    "vae_examples": {"B": 8, "I": 784, "H": 8, "L": 4},  # the example's [B, 1, 28, 28] batches
}


@pytest.mark.parametrize("optimizer", ["none", "adam"])
@pytest.mark.parametrize("name", sorted(TINY_SIZES))
def test_benchmark_training_rows_run_and_match(name, optimizer):
    workload = dataclasses.replace(benchmark.WORKLOADS[name], sizes={"default": TINY_SIZES[name]})
    row = benchmark.run_case(workload, "default", torch.device("cpu"), min_run_time=0.001, use_compile=False,
                             train=True, optimizer=optimizer)
    assert row["workload"] == f"{name}_train" and row["mode"] == "train" and "error" not in row
    eager, fused = row["variants"]["eager"], row["variants"]["fused"]
    assert eager["status"] == "ok" and fused["status"] == "ok", (eager, fused)
    assert fused["match"] is True and fused["max_abs_err"] <= 1e-3
    assert eager["median_us"] > 0 and fused["median_us"] > 0
    assert row["speedup"]["eager"] == pytest.approx(eager["median_us"] / fused["median_us"])
    # Reported for CUDA runs: the VAE rows carry the relative targets.
    benchmark.add_targets(row, workload)
    if name == "vae":
        assert row["speedup_targets"] == {"eager": 3.0, "compile_ro": 1.0}
        assert row["meets_target"] is None  # compile_ro not timed here
    headers, cells = benchmark.build_table([row], cuda=True)
    assert len(cells[0]) == len(headers)


def test_training_step_gradients_reach_every_parameter():
    """The step's outputs are (loss, grad of each parameter), and the
    importance sampler's five tensors are trainable parameters on both modules."""
    workload = benchmark.WORKLOADS["importance_sampling"]
    torch.manual_seed(0)
    reference = workload.build_trainable(workload.make_reference(TINY_SIZES["importance_sampling"]))
    assert sorted(n for n, _ in reference.named_parameters()) == sorted(benchmark.IS_TENSORS)
    fused = workload.build_fused_trainable(reference)
    assert all(p is q for p, q in zip(fused.parameters(), reference.parameters()))
    (samples,) = workload.make_inputs(TINY_SIZES["importance_sampling"])
    grads = {}
    for label, module in (("reference", reference), ("fused", fused)):
        step = benchmark.make_train_step(module, list(reference.parameters()), workload.train_loss, "none")
        grads[label] = step(samples)
    assert len(grads["fused"]) == 1 + len(benchmark.IS_TENSORS)
    for r, f in zip(grads["reference"], grads["fused"]):
        torch.testing.assert_close(f, r, atol=1e-4, rtol=1e-4)
    assert all(g.abs().sum() > 0 for g in grads["reference"][1:])


def test_train_ops_names_select_training_rows():
    args = benchmark.parse_args(["--ops", "vae_train,flow_train"])
    assert args.train and args.ops == "vae,flow"
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--ops", "vae_train,flow"])
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--optimizer", "adam"])


def test_batch_option_rewrites_the_batch_size_and_drops_targets():
    vae, is_ = benchmark.WORKLOADS["vae"], benchmark.WORKLOADS["importance_sampling"]
    (got,) = benchmark.at_batch([vae, is_], 1024)  # importance_sampling has no B
    assert got.name == "vae" and set(got.sizes) == set(vae.sizes)
    assert all(p["B"] == 1024 and {**p, "B": vae.sizes[k]["B"]} == vae.sizes[k] for k, p in got.sizes.items())
    assert got.targets_us == {} and got.train_speedup_targets == {}
    assert vae.sizes["default"]["B"] == 128  # the table's own workload is unchanged
    assert benchmark.parse_args(["--batch", "1024"]).batch == 1024
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--batch", "0"])


def test_fused_compile_ro_sits_beside_fused_not_among_the_baselines():
    """The fused module under reduce-overhead (CUDA runs) is a second fused
    column: ordered after "fused", never a speed-up baseline."""
    ok = {"status": "ok", "median_us": 10.0}
    row = {"workload": "vae_train", "size": "default", "shape": "B=1", "mode": "train",
           "variants": {"eager": {**ok, "median_us": 40.0}, "compile_ro": {**ok, "median_us": 20.0},
                        "fused_compile_ro": {**ok, "median_us": 5.0}, "fused": ok}}
    row["speedup"] = benchmark.speedups(row)
    assert row["speedup"] == {"eager": 4.0, "compile_ro": 2.0}
    assert benchmark.ordered_variants([row]) == ["eager", "compile_ro", "fused", "fused_compile_ro"]
    headers, cells = benchmark.build_table([row], cuda=False)
    assert "x fused_compile_ro" not in headers and "x fused" not in headers
    assert cells[0][headers.index("fused_compile_ro")] == benchmark.format_us(5.0)


def test_bfloat16_vae_row_reports_float64_errors():
    # The vae_bf16 forward row: fused bfloat16 checked against eager bfloat16
    # within the workload's tolerance; every variant's error against a float64
    # run on the same values is reported, output by output.
    workload = dataclasses.replace(benchmark.WORKLOADS["vae_bf16"], sizes={"default": {"B": 8, "I": 16, "H": 8, "L": 4}})
    row = benchmark.run_case(workload, "default", torch.device("cpu"), min_run_time=0.001, use_compile=False)
    eager, fused = row["variants"]["eager"], row["variants"]["fused"]
    assert eager["status"] == "ok" and fused["status"] == "ok", (eager, fused)
    assert fused["match"] is True
    for res in (eager, fused):
        assert len(res["err_vs_float64"]) == 3 and all(0 <= e < 1.0 for e in res["err_vs_float64"])
