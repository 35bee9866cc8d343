"""Kernels of moe_core: each op has a pure-PyTorch reference; Triton versions come beside them.

This package imports nothing of the project's other packages and loads on machines with no GPU.
"""
