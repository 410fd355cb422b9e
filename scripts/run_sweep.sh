#!/usr/bin/env bash
# Load sweep against the P/D proxy with `vllm bench serve`: every (input length, output length, QPS,
# iteration) point once, one result file per point:
#   $RESULT_DIR/<mode>_qps<q>_in<in>_out<out>_iter<i>.json
# which is what `kvpush plot --result-dir $RESULT_DIR --metric ttft|tpot` reads.
#
#   MODE=push scripts/run_sweep.sh      # after ROLE=prefill/decode/proxy MODE=push scripts/serve_pd.sh
#   MODE=pull scripts/run_sweep.sh      # the same lists, after restarting everything with MODE=pull
#
# Settings (environment first, then /etc/kvpush/node.env and ./cluster.env, as in serve_pd.sh):
#   MODE (push)  LABEL (file-name prefix; default $MODE, e.g. LABEL=nixl-push for a third line)
#   QPS_LIST ("1 2 4 8")  INPUT_LENS ("1024 4096 8192 16384")  OUTPUT_LENS ("256")  ITERATIONS (1)
#   NUM_PROMPTS (100 per point)  MODEL  PROXY_HOST (127.0.0.1)  PROXY_PORT (8000)  RESULT_DIR (results)
#   SEED (0)  OVERWRITE=1 to redo points whose file exists  VLLM_BENCH ("vllm bench serve")
#   BENCH_EXTRA_ARGS (appended to every vllm bench serve call)
set -euo pipefail

die() {
  echo "run_sweep.sh: $*" >&2
  exit 1
}

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

case "${1:-}" in
  -h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit 2
    ;;
esac

load_env_file "${KVPUSH_NODE_ENV:-/etc/kvpush/node.env}"
load_env_file "${KVPUSH_CLUSTER_ENV:-./cluster.env}"

MODE=${MODE:-push}
LABEL=${LABEL:-$MODE}
QPS_LIST=${QPS_LIST:-1 2 4 8}
INPUT_LENS=${INPUT_LENS:-1024 4096 8192 16384}
OUTPUT_LENS=${OUTPUT_LENS:-256}
ITERATIONS=${ITERATIONS:-1}
NUM_PROMPTS=${NUM_PROMPTS:-100}
MODEL=${MODEL:-Qwen/Qwen3-32B}
PROXY_HOST=${PROXY_HOST:-127.0.0.1}
PROXY_PORT=${PROXY_PORT:-8000}
RESULT_DIR=${RESULT_DIR:-results}
SEED=${SEED:-0}
VLLM_BENCH=${VLLM_BENCH:-vllm bench serve}
BENCH_EXTRA_ARGS=${BENCH_EXTRA_ARGS:-}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-60}

[[ $LABEL =~ ^[a-z][a-z-]*$ ]] || die "LABEL/MODE '$LABEL' must be lower-case letters and hyphens (it starts each file name)"
[[ $ITERATIONS =~ ^[1-9][0-9]*$ ]] || die "ITERATIONS must be a positive whole number, not '$ITERATIONS'"
read -r -a qps_list <<< "$QPS_LIST"
read -r -a input_lens <<< "$INPUT_LENS"
read -r -a output_lens <<< "$OUTPUT_LENS"
[ "${#qps_list[@]}" -gt 0 ] && [ "${#input_lens[@]}" -gt 0 ] && [ "${#output_lens[@]}" -gt 0 ] ||
  die "QPS_LIST, INPUT_LENS and OUTPUT_LENS must each hold at least one value"
for value in "${qps_list[@]}"; do
  [[ $value =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "QPS_LIST holds '$value', not a number"
done
for value in "${input_lens[@]}" "${output_lens[@]}"; do
  [[ $value =~ ^[1-9][0-9]*$ ]] || die "INPUT_LENS/OUTPUT_LENS hold '$value', not a positive whole number"
done
read -r -a bench <<< "$VLLM_BENCH"
extra=()
if [ -n "$BENCH_EXTRA_ARGS" ]; then
  read -r -a extra <<< "$BENCH_EXTRA_ARGS"
fi

base_url=http://$PROXY_HOST:$PROXY_PORT
if [ "${SKIP_HEALTH:-0}" != 1 ]; then
  deadline=$((SECONDS + HEALTH_TIMEOUT))
  until curl -fsS -o /dev/null --max-time 5 "$base_url/health" 2> /dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || die "the proxy at $base_url/health does not answer 200; start it with ROLE=proxy scripts/serve_pd.sh"
    sleep "${HEALTH_POLL:-2}"
  done
fi

mkdir -p "$RESULT_DIR"
total=$((${#input_lens[@]} * ${#output_lens[@]} * ${#qps_list[@]} * ITERATIONS))
done_points=0
for in_len in "${input_lens[@]}"; do
  for out_len in "${output_lens[@]}"; do
    for qps in "${qps_list[@]}"; do
      for ((iter = 0; iter < ITERATIONS; iter++)); do
        done_points=$((done_points + 1))
        name=${LABEL}_qps${qps}_in${in_len}_out${out_len}_iter${iter}.json
        if [ -f "$RESULT_DIR/$name" ] && [ "${OVERWRITE:-0}" != 1 ]; then
          echo "[$done_points/$total] $name exists, skipped (OVERWRITE=1 to redo)"
          continue
        fi
        echo "[$done_points/$total] $name"
        "${bench[@]}" \
          --backend openai \
          --endpoint /v1/completions \
          --base-url "$base_url" \
          --model "$MODEL" \
          --dataset-name random \
          --random-input-len "$in_len" \
          --random-output-len "$out_len" \
          --ignore-eos \
          --request-rate "$qps" \
          --num-prompts "$NUM_PROMPTS" \
          --seed "$((SEED + iter))" \
          --percentile-metrics ttft,tpot,itl,e2el \
          --metric-percentiles 50,90,99 \
          --save-result \
          --result-dir "$RESULT_DIR" \
          --result-filename "$name" \
          "${extra[@]}"
        [ -f "$RESULT_DIR/$name" ] || die "vllm bench serve wrote no $RESULT_DIR/$name"
      done
    done
  done
done
echo "sweep $LABEL done: $total points in $RESULT_DIR"
