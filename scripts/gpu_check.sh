#!/usr/bin/env bash
# GPU checks for kvpush on a CUDA machine (one prepared run; see README "GPU"). What they cover is listed
# here; they run in another order (below: what has never run on a GPU first, each step capped), and
# scripts/write_cost.py measures kvpush's per-WRITE work on the machine's host; QUICK=1 stops after that.
#  1. tests/gpu: VRAM registered with NIXL, plan-driven WRITE in process, `kvpush demo --device cuda`
#     between two processes, the CUDA event hand-off behind a deliberately slow kernel and host staging
#     from VRAM (two processes on the GPU), every byte verified.
#  2. `kvpush demo` on VRAM and on host DRAM with the default workload, JSON results into $OUT; every demo
#     run reports NIXL's references in the same run: (a) a prepared 1-descriptor handle of each request's
#     size, reposted, (b) kvpush's paged descriptor list prepared and reposted, and (c)/(a), (c)/(b).
#  3. VRAM: contiguous tables (--run-blocks 100000) and large requests, references included.
#  4. scripts/gpu_gather.py: a fragmented request as paged prepared descriptors vs one gather kernel into
#     a registered staging slot, one WRITE, one scatter kernel (bytes verified).
#  5. `kvpush demo --stream --device cuda`: the layer-by-layer prefill on VRAM, each layer's compute a
#     kernel delay (torch.cuda._sleep) followed by the layer's copy and a CUDA event (the range's
#     kv_written barrier), streamed vs one-piece per request size up to 16k tokens, bytes verified.
#  6. vLLM 0.34 (issue 41), run first when present: real `vllm serve` prefill and decode with kvpush on this
#     one GPU (KV in VRAM, kv_buffer_device "cuda", behind kvpush's proxy) and one engine alone, the fast
#     tiny model, greedy tokens compared, with the extensible KV cache on (--enable-extensible-kv-cache)
#     and off (--no-enable-extensible-kv-cache); platforms/vllm/tools/gpu_pd_check.py, capped at
#     VLLM034_S seconds (420). It needs a Python with vLLM 0.34 (VLLM034_PY, default $PY): without one it
#     says so and skips (VLLM034_REQUIRED=1 makes that a failure). VLLM034_ONLY=1 runs only this step.
# Without a GPU (no nvidia-smi, or it lists none) it says so and exits 0: nothing here can run.
# Wheels for an offline machine can be carried in .whl/ (nixl, nixl-cu13, msgspec, pyzmq).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
  echo "gpu_check: no GPU on this machine (nvidia-smi missing or lists no GPU): nothing was run"
  echo "gpu_check: no GPU: skipped (every step, the vLLM 0.34 step included)"
  exit 0
fi
PY=${PY:-python3}
OUT=${OUT:-/tmp/kvpush-gpu}
SITE=${SITE:-/tmp/kvpush-site}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
# install kvpush itself; where the machine's setuptools cannot build it (offline, older than 77) lay the
# package out by copy as an install would (backends/ -> kvpush/backends, platforms/ -> kvpush/platforms)
if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . >"$OUT/install.log" 2>&1; then
  echo "gpu_check: pip could not build kvpush here ($(tail -1 "$OUT/install.log")); laid out by copy"
  rm -rf "$SITE/kvpush" && cp -r kvpush "$SITE/kvpush" && cp -r backends "$SITE/kvpush/backends" && cp -r platforms "$SITE/kvpush/platforms"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} NIXL_LOG_LEVEL=WARN
cd /tmp  # import kvpush from the installed copy, not the source tree
nvidia-smi -L || true
"$PY" -c "import torch, nixl; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
status=0
# tests/gpu (event hand-off behind a slow kernel, staging from VRAM, two processes): without CUDA they
# would all skip, so that counts as a failure here; -rs lists any skip, the JUnit XML keeps the results.
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || { echo "torch sees no CUDA: tests/gpu would only skip" | tee "$OUT/gpu_tests.log"; status=1; }
# each step is capped (STEP_S seconds, default 120; tests/gpu GPU_TESTS_S, 240) so the whole run fits one device call;
# steps run in the order of what has never run on a GPU before, a step over its cap counts as a failure
S=${STEP_S:-120}
VPY=${VLLM034_PY:-$PY}
if "$VPY" -c "import sys, vllm; sys.exit(0 if vllm.__version__.startswith('0.34.') else 1)" >/dev/null 2>&1; then
  timeout "${VLLM034_S:-420}" "$VPY" -m kvpush.platforms.vllm.tools.gpu_pd_check --device cuda --extensible on --extensible off --out "$OUT/vllm034" 2>&1 | tee "$OUT/vllm034.log" || status=1
else
  echo "gpu_check: vLLM 0.34 step skipped: $VPY has no vLLM 0.34 (set VLLM034_PY to a Python with vllm==0.34.*)" | tee "$OUT/vllm034.log"
  [ -z "${VLLM034_REQUIRED:-}" ] || status=1
fi
if [ -n "${VLLM034_ONLY:-}" ]; then
  exit $status
fi
timeout ${GPU_TESTS_S:-240} "$PY" -m pytest -q -rs -p no:cacheprovider --import-mode=importlib --rootdir=/tmp --junitxml="$OUT/gpu_tests.xml" "$OLDPWD/tests/gpu" 2>&1 | tee -a "$OUT/gpu_tests.log" || status=1
# streamed vs one-piece on VRAM, a per-layer kernel delay (0.15 us per token per layer: ~1.2 ms a layer
# at 8k tokens, ~2.5 ms at 16k), fragmented and contiguous tables
timeout $S "$PY" -m kvpush.cli demo --stream --device cuda --stream-sizes 256,1024,4096,8192,16384 --stream-requests 6 --output "$OUT/demo_cuda_stream.json" 2>&1 | tee "$OUT/demo_cuda_stream.log" || status=1
timeout $S "$PY" -m kvpush.cli demo --device cuda --output "$OUT/demo_cuda.json" ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo_cuda.log" || status=1
# kvpush's own work per WRITE (small requests, host DRAM) on a machine with cores to spare
timeout $S "$PY" "$OLDPWD/scripts/write_cost.py" --base none --rounds 3 --variant no_engine_post=--no-engine-post --variant post_4mib="--engine-post-max-bytes 4194304" --json "$OUT/write_cost.json" 2>&1 | tee "$OUT/write_cost.log" || status=1
if [ -z "${QUICK:-}" ]; then
  timeout $S "$PY" -m kvpush.cli demo --stream --device cuda --stream-sizes 1024,8192,16384 --stream-requests 6 --run-blocks 100000 --output "$OUT/demo_cuda_stream_contig.json" 2>&1 | tee "$OUT/demo_cuda_stream_contig.log" || status=1
  timeout $S "$PY" -m kvpush.cli demo --device cpu --output "$OUT/demo_cpu.json" ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo_cpu.log" || status=1
  timeout $S "$PY" -m kvpush.cli demo --device cuda --requests 16 --run-blocks 100000 --output "$OUT/demo_cuda_contig.json" 2>&1 | tee "$OUT/demo_cuda_contig.log" || status=1
  timeout $S "$PY" -m kvpush.cli demo --device cuda --requests 16 --min-tokens 16384 --max-tokens 16384 --run-blocks 100000 --output "$OUT/demo_cuda_16k_contig.json" 2>&1 | tee "$OUT/demo_cuda_16k_contig.log" || status=1
  timeout $S "$PY" "$OLDPWD/scripts/gpu_gather.py" 32 16384 8 5 2>&1 | tee "$OUT/gpu_gather.json" || status=1
fi
exit $status
