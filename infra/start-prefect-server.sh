#!/usr/bin/env bash
# Start a Prefect API server on 127.0.0.1 in the background; print its URL and pid.
#
#   infra/start-prefect-server.sh [PORT]
#
# PORT: default $PREFECT_PORT or 4200. State (Prefect's home and database, log, pid file) goes to
# $MOE_INFRA_DIR (default ./.moe-infra). Stop it with infra/stop.sh prefect-server.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

port="${1:-${PREFECT_PORT:-4200}}"
state="$(moe_state_dir)"
export PREFECT_HOME="${PREFECT_HOME:-$state/prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
# Logs streamed to watchers: `prefect deployment run ... --watch` then shows the flow run's log
# (progress, the summary, a refusal's sentence), not only its state changes.
export PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED="${PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED:-true}"
export PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED="${PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED:-true}"
mkdir -p "$PREFECT_HOME"
log="$state/prefect-server.log"

moe_port_free "$port"
moe_start prefect-server "$log" prefect server start --host 127.0.0.1 --port "$port"
moe_wait_http "http://127.0.0.1:$port/api/health" "$MOE_PID" "$log" "${PREFECT_START_TIMEOUT:-90}"
echo "started prefect server: http://127.0.0.1:$port/api (pid $MOE_PID, home $PREFECT_HOME, log $log)"
echo "use it with: export PREFECT_API_URL=http://127.0.0.1:$port/api"
