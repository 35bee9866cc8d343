#!/usr/bin/env bash
# Register every deployment of infra/prefect.yaml (pretrain/tiny, pretrain/olmoe-1b-7b, ...)
# with the Prefect server.
#
#   infra/deploy.sh [PREFECT_FILE] [API_URL]
#
# PREFECT_FILE: default infra/prefect.yaml. API_URL: default $PREFECT_API_URL or
# http://127.0.0.1:4200/api. Runs from the repository root, so entrypoints in the file are
# relative to it (flows/pretrain.py:pretrain). When an MLflow server answers at
# $MLFLOW_TRACKING_URI (default http://127.0.0.1:$MLFLOW_PORT, port 5000), its URI is stored in
# the Prefect variable mlflow_tracking_uri, so flow runs of every worker log there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
file="${1:-$root/infra/prefect.yaml}"
file="$(cd "$(dirname "$file")" && pwd)/$(basename "$file")"
export PREFECT_API_URL="${2:-${PREFECT_API_URL:-http://127.0.0.1:4200/api}}"
state="$(moe_state_dir)"
export PREFECT_HOME="${PREFECT_HOME:-$state/prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
mkdir -p "$PREFECT_HOME"

if [ ! -f "$file" ]; then
    echo "error: $file does not exist: pass the prefect.yaml to deploy." >&2
    exit 1
fi
cd "$root"
prefect --no-prompt deploy --all --prefect-file "$file"
echo "deployed every deployment of $file to $PREFECT_API_URL (list them: prefect deployment ls)"

# Flow runs log to the MLflow server when it answers: its URI goes into the Prefect variable
# mlflow_tracking_uri, which the flow reads after tracking.uri and MLFLOW_TRACKING_URI.
mlflow_uri="${MLFLOW_TRACKING_URI:-http://127.0.0.1:${MLFLOW_PORT:-5000}}"
case "$mlflow_uri" in
http://* | https://*)
    if moe_http_ok "${mlflow_uri%/}/health"; then
        prefect variable set mlflow_tracking_uri "$mlflow_uri" --overwrite >/dev/null
        echo "flow runs log to MLflow at $mlflow_uri (Prefect variable mlflow_tracking_uri)"
    else
        echo "no MLflow server answers at $mlflow_uri: the Prefect variable mlflow_tracking_uri" \
            "is left as it was (start infra/start-mlflow.sh, then deploy again)"
    fi
    ;;
*)
    echo "MLFLOW_TRACKING_URI=$mlflow_uri is no server: the Prefect variable" \
        "mlflow_tracking_uri is left as it was"
    ;;
esac
