#!/usr/bin/env bash
# Draw the push-vs-pull figures from a sweep's results folder: one PNG per metric, one panel per input
# length, QPS on the x axis, one line per mode (file-name prefix).
#
#   scripts/plot_push_vs_pull.sh [RESULT_DIR]     # default: results; writes RESULT_DIR/ttft.png, tpot.png
#   METRICS="ttft tpot itl" STAT=p99 scripts/plot_push_vs_pull.sh results
set -euo pipefail

RESULT_DIR=${1:-${RESULT_DIR:-results}}
METRICS=${METRICS:-ttft tpot}
STAT=${STAT:-median}
KVPUSH_BIN=${KVPUSH_BIN:-kvpush}

[ -d "$RESULT_DIR" ] || {
  echo "plot_push_vs_pull.sh: no folder $RESULT_DIR (run scripts/run_sweep.sh first)" >&2
  exit 1
}
read -r -a metrics <<< "$METRICS"
for metric in "${metrics[@]}"; do
  "$KVPUSH_BIN" plot --result-dir "$RESULT_DIR" --metric "$metric" --stat "$STAT" --out "$RESULT_DIR/$metric.png"
  echo "wrote $RESULT_DIR/$metric.png"
done
