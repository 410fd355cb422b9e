#!/usr/bin/env bash
# Stop what scripts/serve_pd.sh started on this node, and nothing else.
#
#   scripts/cleanup.sh server    # the prefill and/or decode vLLM engine of this node
#   scripts/cleanup.sh proxy     # the kvpush proxy
#   scripts/cleanup.sh all       # both
#
# serve_pd.sh starts each process as the leader of a process group of its own (setsid) and writes its
# pid to $KVPUSH_RUN_DIR/<name>.pid (default /tmp/kvpush-run). This script signals that group (so the
# engine's worker processes go too): SIGTERM, then SIGKILL after GRACE seconds (default 30). A pid file
# whose process is gone, or whose pid is no longer a process-group leader (the pid was reused by an
# unrelated process), is only removed.
set -euo pipefail

RUN_DIR=${KVPUSH_RUN_DIR:-/tmp/kvpush-run}
GRACE=${GRACE:-30}

usage() {
  echo "usage: $0 server|proxy|all" >&2
  exit 2
}

# Stop the process group led by the pid in pid file $1.
stop_from_pid_file() {
  local pid_file=$1 name pid pgid
  name=$(basename "$pid_file" .pid)
  if [ ! -f "$pid_file" ]; then
    echo "$name: not started by serve_pd.sh here (no $pid_file)"
    return 0
  fi
  pid=$(cat "$pid_file")
  if ! [[ $pid =~ ^[0-9]+$ ]]; then
    echo "$name: $pid_file does not hold a pid; removing it" >&2
    rm -f "$pid_file"
    return 0
  fi
  if ! kill -0 "$pid" 2> /dev/null; then
    echo "$name: pid $pid is gone; removing $pid_file"
    rm -f "$pid_file"
    return 0
  fi
  pgid=$(ps -o pgid= -p "$pid" | tr -d ' ')
  if [ "$pgid" != "$pid" ]; then
    # Not the group leader serve_pd.sh started: the pid was reused by someone else's process.
    echo "$name: pid $pid is not the process group serve_pd.sh started; leaving it alone" >&2
    rm -f "$pid_file"
    return 0
  fi
  echo "$name: stopping process group $pid"
  kill -TERM -- "-$pid" 2> /dev/null || true
  local waited=0
  while kill -0 -- "-$pid" 2> /dev/null; do
    if [ "$waited" -ge "$GRACE" ]; then
      echo "$name: still running after $GRACE s; sending SIGKILL"
      kill -KILL -- "-$pid" 2> /dev/null || true
      break
    fi
    sleep 1
    waited=$((waited + 1))
  done
  rm -f "$pid_file"
  echo "$name: stopped"
}

[ $# -eq 1 ] || usage
case $1 in
  server)
    stop_from_pid_file "$RUN_DIR/server-prefill.pid"
    stop_from_pid_file "$RUN_DIR/server-decode.pid"
    ;;
  proxy)
    stop_from_pid_file "$RUN_DIR/proxy.pid"
    ;;
  all)
    stop_from_pid_file "$RUN_DIR/proxy.pid"
    stop_from_pid_file "$RUN_DIR/server-prefill.pid"
    stop_from_pid_file "$RUN_DIR/server-decode.pid"
    ;;
  *) usage ;;
esac
