#!/usr/bin/env bash
# One call on a GPU machine (the device tool): the GPU tests of every package, then the GPU
# benchmarks. Logs go to $OUT (or ./gpu-logs). Usage:
#   bench/gpu_check.sh tests     # pytest -m gpu over tests/
#   bench/gpu_check.sh bench     # move_kv, transport --cuda, nvlink benchmarks, each with --record:
#                                # their sections of bench/RESULTS.md are rewritten, and the file
#                                # is copied to $OUT
#   bench/gpu_check.sh transfer  # bench transfer --record, the Llama-3-70B preset (pages 1 and 16,
#                                # TP 1:1 and 1:2, 1k-16k tokens, every path): JSON + PNGs in
#                                # $OUT/transfer, RESULTS.md copied to $OUT (one GPU or two)
# NIXL wheels carried in .whl/ (see README) are installed to /tmp/site first.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
rc=0
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(tests bench)
for what in "${steps[@]}"; do
    case "$what" in
        tests) python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts= tests 2>&1 | tee "$OUT/gpu_tests.log" || rc=1 ;;
        bench)
            python3 -m kvtransfer bench move_kv --record 2>&1 | tee "$OUT/bench_move_kv.log" || rc=1
            python3 -m kvtransfer bench transport --record --cuda 2>&1 | tee "$OUT/bench_transport_cuda.log" || rc=1
            python3 -m kvtransfer bench nvlink --record 2>&1 | tee "$OUT/bench_nvlink.log" || rc=1
            cp bench/RESULTS.md "$OUT/RESULTS.md" ;;
        transfer)
            python3 -m kvtransfer bench transfer --record --models llama3-70b --page-sizes 1,16 --tp 1:1,1:2 \
                --tokens ${KVT_TRANSFER_TOKENS:-1k,4k,16k} --budget-s 5 --out "$OUT/transfer" 2>&1 | tee "$OUT/bench_transfer.log" || rc=1
            cp bench/RESULTS.md "$OUT/RESULTS.md" ;;
        *) echo "unknown step $what (tests | bench | transfer)" >&2; exit 2 ;;
    esac
done
exit $rc
