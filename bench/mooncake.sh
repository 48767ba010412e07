#!/usr/bin/env bash
# kvtransfer bench transport --mooncake: kvtransfer's fixed cost per small write beside bare NIXL
# and Mooncake's Transfer Engine (tcp), alternated in one run on this machine. Installs the
# mooncake-transfer-engine wheel and the CUDA 12 runtime it links into .mooncake/ (once) and,
# where no GPU driver is installed, builds a stand-in libcuda.so.1 that answers "no device"
# (bench/mooncake/libcuda_stub.c; the tcp transport never calls the driver). Arguments go to
# bench transport, e.g.  bench/mooncake.sh --total 16M --blocks 256K --iters 1 --fixed-reps 101
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || ./dev setup >/dev/null
site=.mooncake
if [ ! -f "$site/.done" ]; then
    .venv/bin/python -m pip install -q --target "$site" --no-deps "mooncake-transfer-engine==0.3.13.post1" \
        "nvidia-cuda-runtime-cu12==12.9.79"
    touch "$site/.done"
fi
libs="$PWD/$site/nvidia/cuda_runtime/lib"
if ! ldconfig -p | grep -q "libcuda.so.1 "; then
    mkdir -p "$site/stub"
    [ -f "$site/stub/libcuda.so.1" ] || cc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$site/stub/libcuda.so.1" \
        bench/mooncake/libcuda_stub.c
    libs="$libs:$PWD/$site/stub"
fi
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYTHONPATH="$PWD/$site${PYTHONPATH:+:$PYTHONPATH}"
export GLOG_minloglevel=${GLOG_minloglevel:-2}  # Mooncake's own log: errors only
exec .venv/bin/python -m kvtransfer bench transport --mooncake "$@"
