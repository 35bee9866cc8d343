# Shared by the infra/start-*.sh scripts (sourced, not run): where state lives, how a service is
# started detached and how we wait until it answers.

# State folder: logs, pid files, Prefect's home. $MOE_INFRA_DIR, default ./.moe-infra.
moe_state_dir() {
    local dir="${MOE_INFRA_DIR:-.moe-infra}"
    mkdir -p "$dir"
    (cd "$dir" && pwd)
}

# moe_start NAME LOG CMD...: start CMD in its own session (so stop.sh can end it with all of its
# children), output to LOG, pid to <state>/NAME.pid; sets MOE_PID.
moe_start() {
    local name="$1" log="$2"
    shift 2
    setsid "$@" >"$log" 2>&1 </dev/null &
    MOE_PID=$!
    echo "$MOE_PID" >"$(moe_state_dir)/$name.pid"
}

# moe_port_free PORT: fail, saying so, if something already listens on 127.0.0.1:PORT (a
# server started there would exit while the old one answered our health checks).
moe_port_free() {
    if ! python3 -c 'import socket, sys; socket.create_server(("127.0.0.1", int(sys.argv[1]))).close()' \
        "$1" 2>/dev/null; then
        echo "error: port $1 on 127.0.0.1 is in use: choose another port or stop what holds it." >&2
        return 1
    fi
}

# moe_running PID: whether the process runs (an exited one awaiting its reaper does not count).
moe_running() {
    local state
    state="$(ps -o stat= -p "$1" 2>/dev/null | tr -d " ")" || return 1
    [ -n "$state" ] && [ "${state#Z}" = "$state" ]
}

# moe_group_running PGID: whether a process of the group runs (exited ones do not count).
moe_group_running() {
    ps -eo pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ { found = 1 } END { exit !found }'
}

# moe_wait_until PID LOG SECONDS WHAT CMD [ARGS...]: run CMD each second until it succeeds;
# fail (showing the log's end) if the process exits first, or stop it and fail if the time
# runs out. WHAT says what is awaited, for the error messages.
moe_wait_until() {
    local pid="$1" log="$2" seconds="$3" what="$4" waited=0
    shift 4
    until "$@" >/dev/null 2>&1; do
        if ! moe_running "$pid"; then
            echo "error: the process (pid $pid) exited before $what; its log ($log) ends:" >&2
            tail -n 20 "$log" >&2
            return 1
        fi
        if [ "$waited" -ge "$seconds" ]; then
            echo "error: not $what within ${seconds}s (pid $pid, log $log): stopped it." >&2
            kill -TERM -- "-$pid" 2>/dev/null || true
            return 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
}

# moe_http_ok URL: whether URL answers 2xx (quietly: no answer is an answer here).
moe_http_ok() {
    python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1" \
        >/dev/null 2>&1
}

# moe_wait_http URL PID LOG SECONDS: wait until URL answers 2xx (see moe_wait_until).
moe_wait_http() {
    moe_wait_until "$2" "$3" "$4" "$1 answered" moe_http_ok "$1"
}
