"""The entries of op_cases.py, one module per op, and their building blocks (base.py)."""
