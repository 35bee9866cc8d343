#!/usr/bin/env bash
# Start a Prefect worker for a process work pool (it creates the pool if missing); print its pid.
#
#   infra/start-worker.sh [POOL] [API_URL]
#
# POOL: default $PREFECT_WORK_POOL or "local". API_URL: default $PREFECT_API_URL or
# http://127.0.0.1:4200/api (infra/start-prefect-server.sh). Flow runs execute as subprocesses
# of the worker, on this machine. Log and pid file in $MOE_INFRA_DIR (default ./.moe-infra);
# stop it with infra/stop.sh worker-POOL.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

pool="${1:-${PREFECT_WORK_POOL:-local}}"
export PREFECT_API_URL="${2:-${PREFECT_API_URL:-http://127.0.0.1:4200/api}}"
state="$(moe_state_dir)"
export PREFECT_HOME="${PREFECT_HOME:-$state/prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
mkdir -p "$PREFECT_HOME"
log="$state/worker-$pool.log"

if ! moe_http_ok "$PREFECT_API_URL/health" >/dev/null 2>&1; then
    echo "error: no Prefect API answers at $PREFECT_API_URL: start one (infra/start-prefect-server.sh) or pass its URL." >&2
    exit 1
fi
# The worker creates the pool (type process, default job template) when it does not exist.
since="$(python3 -c 'import datetime; print(datetime.datetime.now(datetime.timezone.utc).isoformat())')"
moe_start "worker-$pool" "$log" prefect worker start --pool "$pool" --type process

# Ready once the worker has sent the pool a heartbeat since $since (earlier workers' are older).
worker_beat_since() {
    python3 - "$PREFECT_API_URL" "$pool" "$since" <<'PY'
import datetime, json, sys, urllib.request
def when(text):
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
api, pool, since = sys.argv[1].rstrip("/"), sys.argv[2], when(sys.argv[3])
req = urllib.request.Request(f"{api}/work_pools/{pool}/workers/filter", data=b"{}",
                             headers={"Content-Type": "application/json"}, method="POST")
workers = json.load(urllib.request.urlopen(req, timeout=5))
beats = [when(w["last_heartbeat_time"]) for w in workers if w.get("last_heartbeat_time")]
sys.exit(0 if any(b >= since for b in beats) else 1)
PY
}
moe_wait_until "$MOE_PID" "$log" "${PREFECT_START_TIMEOUT:-90}" \
    "the worker registered with pool $pool" worker_beat_since
echo "started prefect worker: pool $pool on $PREFECT_API_URL (pid $MOE_PID, log $log)"
