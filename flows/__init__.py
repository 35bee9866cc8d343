"""Prefect flows of the moe_core pipeline (tokenize -> init -> train -> convert -> evaluate)."""

import os

# Every Prefect process the project starts (the pipeline's own temporary server included) keeps
# telemetry off: these machines are often offline, where it only logs errors. A value the user
# set wins.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
