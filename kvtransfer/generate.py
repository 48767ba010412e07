"""``kvtransfer generate``: colocated greedy generation (prefill and decode in one TP group).

    kvtransfer generate --model smollm2 --tp 3 --prompt "What is the capital of France?"

The prompt goes through the model's chat template unless ``--raw``; the new text is printed.
With ``--stats`` it reports speed; the random-weights presets (``smollm2-135m-random``,
``llama3-8b``, ``deepseek-v2-lite-mla``) have real shapes and meaningless text, so they run with
``--ignore-eos``; ``--batch N`` runs the prompt as N requests at once:

    kvtransfer generate --model llama3-8b --device cuda --dtype bfloat16 --stats --raw --ignore-eos --prompt hi --batch 64

This is the reference a disaggregated prefill -> decode run is checked against. Bad input (an
unknown model, a TP size the heads do not allow, a prompt longer than the pool) is one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvtransfer._args import HelpFormatter, description
from kvtransfer.models.config import DType, EngineConfig, ModelName


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtransfer generate", description=description(__doc__),
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", required=True, help=", ".join(m.value for m in ModelName))
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (one process per rank)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens at most")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (rank r on cuda:r)")
    ap.add_argument("--raw", action="store_true", help="no chat template: the prompt as it is")
    ap.add_argument("--pool-tokens", type=int, default=4096, help="KV pool size in token slots")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=512, help="prompt tokens per prefill step")
    ap.add_argument("--batch", type=int, default=1,
                    help="run the prompt as this many requests in one continuous batch (with --stats: batched decode speed)")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens (random-weights presets)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="on CUDA, wait for each decode step before launching the next (the overlap's baseline)")
    ap.add_argument("--stats", action="store_true", help="load time and steady-state tokens/s on stderr (after a warm-up run of the same prompts); "
                         "on CUDA also the decode step against its weights' read time")
    return ap


def _check_device(device: str) -> str:
    import torch

    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no CUDA GPU is visible")
    return device


def _generate(args) -> int:
    import torch

    from kvtransfer.models import launch, registry
    from kvtransfer.models.engine import check_request
    from kvtransfer.models.jobs import Generate

    name, dtype, device = ModelName.parse(args.model), DType.parse(args.dtype), _check_device(args.device)
    start = time.perf_counter()
    registry.load_config(name).check_tp(args.tp)
    if args.device == "cuda" and args.tp > torch.cuda.device_count():
        raise ValueError(f"--tp {args.tp} needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    if not isinstance(args.batch, int) or args.batch < 1:
        raise ValueError(f"--batch must be a positive int, got {args.batch!r}")
    ec = EngineConfig(max_tokens=args.pool_tokens, page_size=args.page_size, max_requests=args.batch,
                      chunk_size=args.chunk_size, dtype=dtype.torch, device=device, overlap=not args.no_overlap)
    spec, tokenizer = registry.load(name)
    load_s = time.perf_counter() - start  # the file's metadata, weights and tokenizer
    text = args.prompt if args.raw else tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    prompt = tokenizer.encode(text)
    check_request(prompt, args.max_tokens, ec, spec.config)
    stop_ids = frozenset() if args.ignore_eos else tokenizer.stop_ids
    out = launch.run(spec, args.tp, ec, Generate((tuple(prompt),) * args.batch, args.max_tokens, stop_ids, warmup=args.stats))
    print(tokenizer.decode(out.output_ids[0]))
    if args.stats:
        s = out.stats
        print(f"[{name.value} tp={args.tp} {dtype.value} {device} batch={args.batch}] load {load_s:.2f} s; "
              f"prefill {s.prefill_tokens} tokens {s.rate(s.prefill_tokens, s.prefill_s):.1f} tok/s; "
              f"decode {s.decode_tokens} tokens {s.rate(s.decode_tokens, s.decode_s):.1f} tok/s", file=sys.stderr)
        if device == "cuda" and args.tp == 1 and s.decode_tokens:
            _print_roofline(spec, dtype.torch, s, args.batch)
    return 0


def _print_roofline(spec, dtype, stats, batch: int) -> None:
    from kvtransfer.models.roofline import copy_bandwidth, step_weight_bytes

    step_ms = 1e3 * stats.decode_s / (stats.decode_tokens / batch)
    nbytes, bw = step_weight_bytes(spec, dtype), copy_bandwidth("cuda")
    read_ms = 1e3 * nbytes / bw
    print(f"decode step {step_ms:.3f} ms at batch {batch}; weights {nbytes / 1e9:.2f} GB read at the measured "
          f"copy bandwidth {bw / 1e12:.2f} TB/s = {read_ms:.3f} ms (step / read {step_ms / read_ms:.2f}x)",
          file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from kvtransfer.models.gguf_llama import MissingModelFile
    from kvtransfer.models.launch import RankFailed

    args = _parser().parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, MissingModelFile) as e:
        print(f"kvtransfer generate: error: {e}", file=sys.stderr)
        return 2
    except RankFailed as e:
        print(f"kvtransfer generate: error: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
