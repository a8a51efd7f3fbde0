#!/usr/bin/env bash
# One call on a lent GPU machine: install, CUDA plugin tests, conformance suite, benchmarks.
# Logs and result files go to $OUT (one tarball, results.tgz); a short summary is printed last.
# Usage: bash plugins/cuda/tools/gpu_session.sh [tests] [conformance] [conformance_all] [bench] [concurrency] [transfer]
#        [probe] [ray] [opencl]
#        (default: tests conformance bench; conformance_all runs the suite on every CUDA GPU, e.g. cuda:0 and cuda:1)
set -u
export PYTHONUNBUFFERED=1
# cupy's compiled-kernel cache: carried between calls (name .cupy_cache in carry) to skip NVRTC
export CUPY_CACHE_DIR=$PWD/.cupy_cache; mkdir -p "$CUPY_CACHE_DIR"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
PHASES=${*:-tests conformance bench}
SUMMARY="$OUT/logs/summary.txt"; : > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/logs/gpu.txt" 2>&1
export POLYHAL_BENCH_GPU="$(head -1 "$OUT/logs/gpu.txt")"
# Result files are named after the card that ran them (-h100, -h200; -gpu for another)
SFX=-$(grep -oiE 'h100|h200|a100|l40s?' "$OUT/logs/gpu.txt" | head -1 | tr 'A-Z' 'a-z'); [ "$SFX" = "-" ] && SFX=-gpu
note "gpu: $POLYHAL_BENCH_GPU; $(python3 --version 2>&1); cupy $(python3 -c 'import cupy; print(cupy.__version__)' 2>&1)"
# Wheels the machine lacks travel in .whl (pyopencl, cudnn-frontend, pytest-timeout...: see ../shared/GPU.md)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl > "$OUT/logs/wheels.txt" 2>&1
  export PYTHONPATH=$PWD/.site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cpu -e plugins/gpu -e plugins/cuda > "$OUT/logs/install.txt" 2>&1 \
  || { note "editable install failed: see install.txt"; export PYTHONPATH=$PWD/core:$PWD/plugins/cpu:$PWD/plugins/gpu:$PWD/plugins/cuda; }
polyhal devices > "$OUT/logs/devices.txt" 2>&1; cat "$OUT/logs/devices.txt" | head -8

run() {  # name timeout command...
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout "$t" "$@" > "$OUT/logs/$name.txt" 2>&1; local rc=$?
  note "$name: rc=$rc ($(( $(date +%s) - t0 )) s) $(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed' "$OUT/logs/$name.txt" | tail -1)"
}
for phase in $PHASES; do
  case $phase in
    tests) run cuda_tests "${T_TESTS:-240}" python3 -m pytest -q -ra -p no:cacheprovider --timeout=90 plugins/cuda/tests ${TEST_ARGS:-} ;;
    conformance) run conformance_cuda "${T_CONF:-120}" python3 -m pytest -q -ra -p no:cacheprovider --timeout=60 tests/test_conformance.py --polyhal-backend=cuda ;;
    bench) run bench_cuda "${T_BENCH:-200}" python3 -m bench cuda_plan cuda_matmul cuda_sort cuda_nms cuda_transfer --suffix=$SFX ${BENCH_ARGS:-} ;;
    concurrency) run bench_concurrency "${T_BENCH:-200}" python3 -m bench concurrency --suffix=$SFX ${BENCH_ARGS:-} ;;
    transfer) run transfer_tests "${T_TRANSFER:-150}" python3 -m pytest -q -ra -p no:cacheprovider --timeout=60 plugins/cuda/tests/test_cuda_transfer.py tests/test_queues.py ;;
    probe) run overlap_probe "${T_PROBE:-180}" env PYTHONPATH="$PWD:${PYTHONPATH:-}" python3 plugins/cuda/tools/overlap_probe.py cuda:0 ;;
    ray)  # remote CUDA through Ray (issue 29): Ray travels as a stripped bundle, see plugins/ray/tools/remote_cuda.sh
      tar xJf .raybundle/ray-bundle.tar.xz -C .site && python3 -m pip install -q --no-deps --no-build-isolation -e plugins/ray >> "$OUT/logs/install.txt" 2>&1
      run remote_cuda "${T_RAY:-420}" bash plugins/ray/tools/remote_cuda.sh ;;
    conformance_all) for d in $(polyhal devices 2>/dev/null | grep -oE '^ *cuda:[0-9]+' | tr -d ' '); do
        run "conformance_${d/:/}" "${T_CONF:-120}" python3 -m pytest -q -ra -p no:cacheprovider --timeout=60 tests/test_conformance.py --polyhal-device="$d"; done ;;
    bench_*) run "$phase" "${T_BENCH:-120}" python3 -m bench "cuda_${phase#bench_}" --suffix=$SFX ${BENCH_ARGS:-} ;;
    opencl)
      mkdir -p .vendors && echo libnvidia-opencl.so.1 > .vendors/nvidia.icd && export OCL_ICD_VENDORS=$PWD/.vendors
      python3 -m pip install -q --no-deps --no-build-isolation -e plugins/opencl >> "$OUT/logs/install.txt" 2>&1
      polyhal devices > "$OUT/logs/devices_opencl.txt" 2>&1
      run conformance_opencl "${T_OCL:-150}" python3 -m pytest -q -ra -p no:cacheprovider --timeout=60 tests/test_conformance.py --polyhal-backend=opencl
      for b in bench/opencl_*.py; do [ -e "$b" ] && run "$(basename "$b" .py)" "${T_OCLB:-90}" python3 -m bench "$(basename "$b" .py)" --suffix=$SFX; done ;;
  esac
done
echo "===== summary"; cat "$SUMMARY"
for f in "$OUT"/logs/*.txt; do case $f in *summary*|*install*|*gpu*) ;; *) echo "--- $(basename $f) (tail)"; grep -E "FAILED|ERROR|Error|error:|^\| " "$f" | head -40;; esac; done
# Everything comes back in (at most) two files: the logs and results, and cupy's kernel cache.
tar czf "$OUT/results.tgz" -C "$OUT" logs -C "$PWD" bench/results 2>/dev/null && rm -rf "$OUT/logs"
[ -n "${NOCACHE:-}" ] || tar czf "$OUT/cupy_cache.tgz" -C "$PWD" .cupy_cache 2>/dev/null
