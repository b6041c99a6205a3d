#!/usr/bin/env bash
# The GPU checks of issue 10, in one go, on a machine with CUDA (a few minutes):
#   1. tests/gpu/test_gpu.py (+ the device/serialization unit tests), CUDA IPC on (the default);
#   2. tests/gpu/test_gpu.py again with RREFRT_CUDA_IPC=0 (host staging), the kill test left out;
#   3. bench/bench_gpu.py --quick: cuda:0 -> cuda:0 round trips, 1 MB..256 MB, beside torch.
# Needs python3 with torch (CUDA), msgpack, pytest and pytest-timeout. pyzmq (and anything
# else missing) is installed from the wheels in .whl/ into /tmp/rrefrt-site when it cannot be
# imported; no pip install -e: the checkout goes on PYTHONPATH. The log is also written to
# $GPU_CHECK_LOG (default: $OUT/gpu_check.log where $OUT is set, else /tmp/gpu_check.log).
# Exit status: 0 when every step passed. Worst case (every step at its limit) about 9 minutes:
# run it with timeout_s=570 and `carry: [".whl"]`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${GPU_CHECK_LOG:-${OUT:-/tmp}/gpu_check.log}
exec > >(tee "$LOG") 2>&1

if ! "$PY" -c "import zmq" 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check: pyzmq is missing and .whl/ holds no wheels to install it from"; exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/rrefrt-site .whl/*.whl || { echo "gpu_check: installing .whl/ failed"; exit 2; }
    export PYTHONPATH=/tmp/rrefrt-site
fi
# the checkout on PYTHONPATH; its transport/ folder installs as rrefrt_transport (pyproject's
# package-dir), so without an install it is reached through a link of that name
mkdir -p /tmp/rrefrt-src && ln -sfn "$PWD/transport" /tmp/rrefrt-src/rrefrt_transport
export PYTHONPATH="$PWD:/tmp/rrefrt-src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

"$PY" - <<'PYEOF' || exit 2
import sys, torch, zmq, msgpack, pytest
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"pyzmq {zmq.__version__}, msgpack {'.'.join(map(str, msgpack.version))}, pytest {pytest.__version__}")
print(f"CUDA available: {torch.cuda.is_available()}, devices: "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
PYEOF

rc=0
step() { echo; echo "== $1 ($(date -u +%T))"; }
ok() { local r=$?; [ $r = 0 ] || [ $r = 5 ]; }  # pytest's 5: nothing collected (CUDA absent: skipped)
step "1/3 GPU tests, CUDA IPC on"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs -s tests/gpu/test_gpu.py tests/unit/test_devices.py \
    tests/unit/test_serialization.py; ok || rc=1
step "2/3 GPU tests, CUDA IPC off (host staging)"
RREFRT_CUDA_IPC=0 timeout 150 "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu.py -k "not killed"; ok || rc=1
step "3/3 GPU bench (quick)"
timeout 150 "$PY" bench/bench_gpu.py --quick --timeout 70 || rc=1
echo; echo "gpu_check: $([ $rc = 0 ] && echo PASSED || echo FAILED) ($(date -u +%T))"
exit $rc
