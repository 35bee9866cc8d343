#!/usr/bin/env bash
# Start an MLflow tracking server on 127.0.0.1: sqlite backend store, artifacts served by the
# server from a local folder, one worker. Print its URL and pid.
#
#   infra/start-mlflow.sh [PORT] [DIR]
#
# PORT: default $MLFLOW_PORT or 5000. DIR: default $MOE_MLFLOW_DIR or $MOE_INFRA_DIR/mlflow
# (MOE_INFRA_DIR default ./.moe-infra); it holds mlflow.db and artifacts/. Point runs at it with
# tracking=server (conf/tracking/server.yaml) or MLFLOW_TRACKING_URI. Stop with infra/stop.sh mlflow.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

port="${1:-${MLFLOW_PORT:-5000}}"
state="$(moe_state_dir)"
dir="${2:-${MOE_MLFLOW_DIR:-$state/mlflow}}"
mkdir -p "$dir/artifacts"
dir="$(cd "$dir" && pwd)"
log="$state/mlflow.log"
# Server-side jobs (GenAI evaluation and the like) start a pool of extra processes that run
# tracking does not need; turn them back on with MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"

moe_port_free "$port"
moe_start mlflow "$log" mlflow server --host 127.0.0.1 --port "$port" \
    --backend-store-uri "sqlite:///$dir/mlflow.db" \
    --serve-artifacts --artifacts-destination "$dir/artifacts" \
    --workers 1
moe_wait_http "http://127.0.0.1:$port/health" "$MOE_PID" "$log" "${MLFLOW_START_TIMEOUT:-90}"
echo "started mlflow server: http://127.0.0.1:$port (pid $MOE_PID, store $dir/mlflow.db, artifacts $dir/artifacts, log $log)"
echo "use it with: export MLFLOW_TRACKING_URI=http://127.0.0.1:$port"
