#!/usr/bin/env bash
# Register the deployments of infra/prefect.yaml (pretrain/tiny, pretrain/olmoe-1b-7b, ...) with
# the Prefect server: each one whose work pool exists there (a worker creates its pool when it
# starts: infra/start-worker.sh); the others are named, with the pool they wait for, and left
# out (deploy again once their pool exists).
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
if ! moe_http_ok "$PREFECT_API_URL/health" >/dev/null 2>&1; then
    echo "error: no Prefect API answers at $PREFECT_API_URL: start one (infra/start-prefect-server.sh) or pass its URL." >&2
    exit 1
fi
# Each deployment with its work pool, and whether the server has that pool: "NAME POOL yes|no".
pools="$(python3 - "$file" "$PREFECT_API_URL" <<'PY'
import json, sys, urllib.request
import yaml
path, api = sys.argv[1], sys.argv[2].rstrip("/")
with open(path) as f:
    deployments = yaml.safe_load(f).get("deployments") or []
request = urllib.request.Request(f"{api}/work_pools/filter", data=b"{}",
                                 headers={"Content-Type": "application/json"}, method="POST")
existing = {pool["name"] for pool in json.load(urllib.request.urlopen(request, timeout=30))}
for d in deployments:
    pool = (d.get("work_pool") or {}).get("name") or "-"
    print(d["name"], pool, "yes" if pool in existing else "no")
PY
)"
names=()
while read -r name pool ok; do
    [ "$ok" = yes ] && names+=(--name "$name")
done <<<"$pools"
if [ "${#names[@]}" -eq 0 ]; then
    echo "error: none of the work pools $file names exists on $PREFECT_API_URL yet: start a" \
        "worker first (infra/start-worker.sh local), then deploy." >&2
    exit 1
fi
cd "$root"
prefect --no-prompt deploy --prefect-file "$file" "${names[@]}"
echo "deployed $(awk '$3 == "yes" { printf "%s%s", sep, $1; sep = ", " }' <<<"$pools")" \
    "to $PREFECT_API_URL (list them: prefect deployment ls)"
# What waits for a pool: named with that pool, once per pool.
for pool in $(awk '$3 == "no" { print $2 }' <<<"$pools" | sort -u); do
    left="$(awk -v p="$pool" '$2 == p { printf "%s%s", sep, $1; sep = ", " }' <<<"$pools")"
    echo "left out $left: the server has no work pool '$pool' yet (infra/README.md says" \
        "where its worker runs and how the pool is made); deploy again once it exists"
done

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
