"""bench/ncu_stalls.py on a small synthetic ncu source CSV (no GPU, no ncu needed)."""

import gzip
import sys
from pathlib import Path

import pytest

# bench/ is not installed: import it from the source tree (appended, as in test_bench_train.py).
sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench import ncu_stalls  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
ROWS = [
    ["0x7f0000000010", "      LDG.E R5, desc[UR4][R2.64]", "2", "2", "64", "0", "2", "0"],
    ["0x7f0000000020", "      FADD R24, R5, R24", "30", "30", "64", "28", "2", "28"],
    ["0x7f0000000030", "@P0   BRA 0x7f0000000010", "8", "8", "128", "0", "8", "0"],
]


def write_csv(path, rows):
    lines = ['"Kernel Name","k(int)",'] + [",".join(f'"{v}"' for v in r) for r in [HEADER] + rows]
    text = "\n".join(lines) + "\n"
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)


@pytest.mark.parametrize("name", ["sass.csv", "sass.csv.gz"])
def test_summary(tmp_path, monkeypatch, capsys, name):
    path = tmp_path / name
    write_csv(path, ROWS)
    monkeypatch.setattr(sys, "argv", ["ncu_stalls", str(path), "--top", "2"])
    ncu_stalls.main()
    out = capsys.readouterr().out
    assert out.startswith("40 samples over 3 SASS lines")
    # long_sb 28 of 40 samples, wait 12; the "(Not Issued)" column is not counted twice
    assert "long_sb 70.0%, wait 30.0%" in out
    # opcodes: the predicate is skipped, suffixes dropped
    assert "FADD                30   75.0         64" in out
    assert "BRA                  8   20.0        128" in out
    top = out.split("top 2 lines")[1].strip().splitlines()[1:]
    assert len(top) == 2
    assert "FADD R24, R5, R24" in top[0] and "long_sb 28, wait 2" in top[0]
    assert "BRA" in top[1] and "LDG" not in out.split("top 2 lines")[1]
