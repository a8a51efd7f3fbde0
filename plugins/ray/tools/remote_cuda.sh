#!/usr/bin/env bash
# Remote CUDA through Ray on one GPU host (issue 29): a `ray start` node on 127.0.0.1 whose runtime
# actor holds the GPU, then the conformance suite on its ray:<node>/cuda:0 and on its cpu:0.
# Ray must be importable. The GPU machine has no package index and a call carries at most 64 MiB, so
# Ray travels as a stripped bundle (the wheel less its Java jar, dashboard client, rllib and llm,
# plus click/msgpack/jsonschema), made by plugins/ray/tools/make_bundle.sh and unpacked here:
#   tar xJf .raybundle/ray-bundle.tar.xz -C .site   (then PYTHONPATH=$PWD/.site:...)
# Usage: bash plugins/ray/tools/remote_cuda.sh   (logs under $OUT/logs)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
ray_cli() { python3 -c 'import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; main()' "$@"; }
site=$(python3 -c 'import ray, os; print(os.path.dirname(ray.__file__))') || { echo "ray is not importable"; exit 1; }
chmod +x "$site/core/src/ray/gcs/gcs_server" "$site/core/src/ray/raylet/raylet" 2>/dev/null
POLYHAL_BACKENDS=cuda,cpu ray_cli start --head --port=6390 --num-cpus=4 --num-gpus=1 \
  --include-dashboard=false --node-ip-address=127.0.0.1 > "$OUT/logs/ray_start.txt" 2>&1 \
  || { echo "ray start failed:"; tail -20 "$OUT/logs/ray_start.txt"; exit 1; }
export POLYHAL_RAY_ADDRESS=127.0.0.1:6390 POLYHAL_BACKENDS=cpu,ray
polyhal devices > "$OUT/logs/ray_devices.txt" 2>&1; cat "$OUT/logs/ray_devices.txt"
rc=0
per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout=120)
for kind in cuda:0 cpu:0; do
  dev=$(grep -oE "ray:[^ ]+/$kind" "$OUT/logs/ray_devices.txt" | head -1)
  [ -n "$dev" ] || { echo "no remote $kind listed"; rc=1; continue; }
  log="$OUT/logs/ray_conformance_${kind/:/}.txt"
  timeout "${T_RAY:-240}" python3 -m pytest -q -p no:cacheprovider $per_test --pyargs polyhal.testing.conformance \
    --polyhal-device="$dev" > "$log" 2>&1 || rc=1
  echo "$dev: $(tail -1 "$log")"; grep -E "^(FAILED|ERROR)" "$log" | head -20
done
ray_cli stop > /dev/null 2>&1
exit $rc
