#!/usr/bin/env bash
# Stop a service started by an infra/start-*.sh script, with its child processes.
#
#   infra/stop.sh NAME     (prefect-server, worker-POOL, mlflow; pid file in $MOE_INFRA_DIR)
#
# The start scripts run each service in its own session, so its process group id is its pid.
# TERM the group and wait $MOE_STOP_GRACE seconds (default 10); then TERM again (a Prefect
# worker answers the first TERM by finishing its flow runs, a second one by exiting) and after
# 5 more seconds KILL what is left. Stop workers before their server: a server shuts down slowly
# while clients still hold connections.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

name="${1:?usage: infra/stop.sh NAME (prefect-server, worker-POOL or mlflow)}"
pidfile="$(moe_state_dir)/$name.pid"
if [ ! -f "$pidfile" ]; then
    echo "error: no pid file $pidfile: was $name started with this MOE_INFRA_DIR?" >&2
    exit 1
fi
pid="$(cat "$pidfile")"

# wait_group PGID SECONDS: until the group is gone or the time is up; fails if it still runs.
wait_group() {
    local ticks=$(($2 * 2))
    while [ "$ticks" -gt 0 ]; do
        moe_group_running "$1" || return 0
        sleep 0.5
        ticks=$((ticks - 1))
    done
    ! moe_group_running "$1"
}

if ! moe_group_running "$pid"; then
    echo "$name (pid $pid) was not running"
elif kill -TERM -- "-$pid" 2>/dev/null && wait_group "$pid" "${MOE_STOP_GRACE:-10}"; then
    echo "stopped $name (pid $pid)"
elif kill -TERM -- "-$pid" 2>/dev/null && wait_group "$pid" 5; then
    echo "stopped $name (pid $pid) after a second TERM"
else
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait_group "$pid" 5 || true
    echo "killed $name (pid $pid)"
fi
rm -f "$pidfile"
