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
# unrelated process), is only removed. Once a group is gone, the temporary directory serve_pd.sh gave it
# and the /dev/shm segments its processes had mapped (vLLM's message queues, which a killed engine
# never unlinks) are removed too.
set -euo pipefail

RUN_DIR=${KVPUSH_RUN_DIR:-/tmp/kvpush-run}
GRACE=${GRACE:-30}

usage() {
  echo "usage: $0 server|proxy|all" >&2
  exit 2
}

# The files under /dev/shm that the processes of group $1 map.
group_shm() {
  local p
  for p in $(pgrep -g "$1" 2> /dev/null); do
    awk '$6 ~ /^\/dev\/shm\// && $7 != "(deleted)" {print $6}' "/proc/$p/maps" 2> /dev/null || true
  done | sort -u
}

# The temporary directory serve_pd.sh made for $1 (<name>.tmp names it), removed with its record.
remove_tmp_dir() {
  local record=$RUN_DIR/$1.tmp dir
  [ -f "$record" ] || return 0
  dir=$(cat "$record")
  case $dir in
    */kvpush-"$1"-*) rm -rf -- "$dir" ;;
    *) echo "$1: $record names $dir, not a directory serve_pd.sh makes; leaving it" >&2 ;;
  esac
  rm -f "$record"
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
    remove_tmp_dir "$name"
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
  local shm
  shm=$(group_shm "$pid")
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
  waited=0
  while kill -0 -- "-$pid" 2> /dev/null && [ "$waited" -lt 50 ]; do
    sleep 0.1 # after SIGKILL: until the kernel has taken the group down
    waited=$((waited + 1))
  done
  if [ -n "$shm" ]; then
    while IFS= read -r f; do rm -f -- "$f"; done <<< "$shm"
  fi
  rm -f "$pid_file"
  remove_tmp_dir "$name"
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
