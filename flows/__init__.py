"""Prefect flows of the moe_core pipeline (tokenize -> init -> train -> convert -> evaluate)."""
