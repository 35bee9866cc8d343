"""GPU benchmark scripts (run as ``python benchmarks/NAME.py``) and their baselines."""
