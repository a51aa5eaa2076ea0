"""Summarise a source-level Nsight Compute profile: where a kernel's warps stall, by SASS line.

Input: the CSV that `ncu --import REPORT.ncu-rep --page source --csv --print-source sass` prints
for a report taken with `--section SourceCounters --section WarpStateStats --import-source yes`
(bench/results/nvidia-h200-gpu-run.txt, twelfth session, runs 1-3, used it on the wgmma kernels).

Prints the stall reasons' shares of all samples, the samples and executed counts per opcode,
and the SASS lines with the most samples (each with its two largest stall reasons), e.g.

    python -m bench.ncu_stalls flow_sass.csv.gz --top 30

A line's samples are charged to the instruction that waits, so a stall on `FADD R24, R5, R24`
with reason long_sb points at the load that wrote R5 a few lines above it.
"""
import argparse
import csv
import gzip
from collections import Counter


def read_rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[start]
    return header, [r for r in rows[start + 1:] if len(r) == len(header)]


def count(value):
    return int(value) if value.isdigit() else 0


def opcode(source):
    words = source.split()
    if not words:
        return ""
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    parser.add_argument("--top", type=int, default=25, help="SASS lines to list (default 25)")
    args = parser.parse_args()

    header, rows = read_rows(args.csv)
    samples = header.index("Warp Stall Sampling (All Samples)")
    source = header.index("Source")
    executed = header.index("Instructions Executed")
    reasons = [(i, h[len("stall_"):]) for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]

    total = sum(count(r[samples]) for r in rows) or 1
    print(f"{total} samples over {len(rows)} SASS lines")
    by_reason = Counter({name: sum(count(r[i]) for r in rows) for i, name in reasons})
    print("stall reasons:", ", ".join(f"{name} {100 * n / total:.1f}%" for name, n in by_reason.most_common(10)))

    by_op, runs = Counter(), Counter()
    for r in rows:
        op = opcode(r[source])
        by_op[op] += count(r[samples])
        runs[op] += count(r[executed])
    print("\nopcode         samples      %   executed")
    for op, n in by_op.most_common(20):
        print(f"{op:12s} {n:9d} {100 * n / total:6.1f} {runs[op]:10d}")

    print(f"\ntop {args.top} lines: address, samples, executed, SASS, two largest reasons")
    for r in sorted(rows, key=lambda r: -count(r[samples]))[: args.top]:
        top2 = sorted(((count(r[i]), name) for i, name in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {n}" for n, name in top2 if n)
        print(f"{r[0][-6:]} {count(r[samples]):6d} {count(r[executed]):9d}  {r[source].strip()[:60]:60s} {why}")


if __name__ == "__main__":
    main()
