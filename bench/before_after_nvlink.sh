#!/usr/bin/env bash
# The nvlink tables on two GPUs, before and after, in one device call (logs in $OUT):
#   bench/before_after_nvlink.sh OLD_TREE [steps...]
# OLD_TREE: a checkout of the code before the direct path (the device call's repository root,
# when this tree travels as a carried folder of it). Steps (default: compare tests):
#   compare     bench nvlink at 1,024 tokens (pages 1, 16, head slices) and 4,096 tokens (page 1,
#               head slices), with OLD_TREE's transport and then this tree's; both runs use this
#               tree's benchmark (the same measurements, the fixed cost per write included), so
#               each table sits beside the peer copy of its own run
#   regression  bench nvlink at 16,384 tokens (pages 1, 16), this tree only
#   crossover   bench nvlink at 8,192 tokens (pages 1, 16), this tree only: with `regression`, where
#               the staged engine starts to beat the direct path end to end (AUTO's min_bytes)
#   cpu         bench/probes/lander_cpu.py with 1 and 8 peers on the second GPU
#   tests       pytest -m gpu over the transport tests (NVLink, strided, direct path, launcher)
#   probe       bench/probes/direct_path_host.py --cuda at 1,024 and 16,384 tokens: the host time of a
#               direct-path write step by step, the timeline after the call, raw CUDA call costs
#   staged      bench/probes/staged_host.py on the second GPU at 1,024 and 4,096 tokens (pages 1, 16),
#               OLD_TREE's transport and then this tree's: a staged write's host steps and DONE
#   fixed       bench nvlink at 1,024 tokens (pages 1, 16), OLD_TREE's transport and this tree's
#               alternated, three rounds: the fixed cost per write, idle and behind compute (the
#               host's speed drifts within a call: one run each would not tell a 10 us change)
# BENCH_ARGS: more arguments for every bench nvlink run ("--dst-device 0": a dry run on one GPU)
set -o pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
old=$(cd "${1:?usage: bench/before_after_nvlink.sh OLD_TREE [compare|regression|crossover|cpu|tests|probe|staged|fixed]...}" && pwd); shift
OUT=${OUT:-$here/gpu-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(compare tests)
before=/tmp/kvt-before
rc=0
before_tree() {  # OLD_TREE's transport with this tree's benchmarks and receiver (its arrival stamps)
    rm -rf "$before" && mkdir -p "$before"
    cp -r "$old/transport" "$before/" && cp -r "$here/kvtransfer" "$here/pools" "$before/"  # kvtransfer/benchmarks/_remote.py: the receiver
}
bench() {  # tree label args... (run from the tree: python -m puts the working directory first)
    local tree=$1 label=$2; shift 2
    (cd "$tree" && PYTHONPATH=$tree${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} python3 -m kvtransfer bench nvlink "$@" $BENCH_ARGS) \
        2>&1 | tee "$OUT/nvlink_${label}.log" || rc=1
}
for what in "${steps[@]}"; do
    case "$what" in
        compare)
            before_tree
            for tokens in 1024 4096; do
                pages=$([ $tokens = 1024 ] && echo 1,16 || echo 1)
                bench "$before" "before_${tokens}" --tokens $tokens --page-sizes $pages
                bench "$here" "after_${tokens}" --tokens $tokens --page-sizes $pages
            done ;;
        fixed)
            before_tree
            for round in 1 2 3; do
                bench "$before" "fixed_before_$round" --tokens 1024 --page-sizes 1,16 --fixed-reps 21
                bench "$here" "fixed_after_$round" --tokens 1024 --page-sizes 1,16 --fixed-reps 21
            done ;;
        regression) bench "$here" after_16384 --tokens 16384 --page-sizes 1,16 ;;
        crossover) bench "$here" after_8192 --tokens 8192 --page-sizes 1,16 ;;
        cpu)
            for peers in 1 8; do
                (cd "$here" && PYTHONPATH=$here${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} python3 \
                    bench/probes/lander_cpu.py --peers $peers --peer-gpu 1) 2>&1 | tee "$OUT/lander_cpu_${peers}.log" || rc=1
            done ;;
        tests)
            (cd "$here" && PYTHONPATH=$here${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} python3 -m pytest -q -m gpu \
                -p no:cacheprovider -o addopts= tests/transport/nvlink/test_nvlink.py tests/transport/nvlink/test_nvlink_fastpath.py \
                tests/transport/test_strided.py tests/transport/nvlink/test_nvlink_staged.py tests/transport/nvlink/test_triton_launch.py \
                tests/transport/nvlink/test_nvlink_lander.py) \
                2>&1 | tee "$OUT/gpu_tests_transport.log" || rc=1 ;;
        probe)
            for tokens in 1024 16384; do
                (cd "$here" && PYTHONPATH=$here${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} python3 \
                    bench/probes/direct_path_host.py --cuda --tokens $tokens --reps 200) \
                    2>&1 | tee "$OUT/direct_path_host_${tokens}.log" || rc=1
            done ;;
        staged)
            before_tree
            for spec in "1024 1" "4096 1" "1024 16" "4096 16"; do
                set -- $spec
                for tree in "$before" "$here"; do
                    label=$([ "$tree" = "$before" ] && echo before || echo after)
                    (cd "$here" && PYTHONPATH=$tree${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} python3 \
                        bench/probes/staged_host.py --peer-gpu 1 --tokens $1 --page $2 --reps 30) \
                        2>&1 | tee "$OUT/staged_host_${label}_$1_$2.log" || rc=1
                done
            done ;;
        *) echo "unknown step $what (compare | regression | crossover | cpu | tests | probe | staged | fixed)" >&2; exit 2 ;;
    esac
done
exit $rc
