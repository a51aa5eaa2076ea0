"""Benchmarks for ``fused_ops``.

Run ``python -m bench.benchmark --help`` from the repository root.  The driver
(:mod:`bench.benchmark`) times the reference programs, their ``torch.compile``
versions and the fused operators; :mod:`bench.plot` draws the bar chart.
"""
