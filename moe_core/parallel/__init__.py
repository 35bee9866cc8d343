"""Parallelism applied to the model from outside: mesh, dispatch, gradient reduction, ZeRO-1,
pipeline schedules and activation recompute."""
