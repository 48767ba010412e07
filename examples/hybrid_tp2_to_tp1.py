"""The hybrid model (attention KV + Mamba2 state) on GPUs: prefill at TP 2 -> decode at TP 1.

    python examples/hybrid_tp2_to_tp1.py

Prefill ranks run on GPUs 0 and 1, the decode rank on the last GPU (GPUs are shared between
processes when there are fewer than three); the planner splits each decode row of KV heads and
Mamba state channels across the two prefill senders. The KV goes over the NVLink engine where
both sides offer it, else NIXL. Completions are checked against a colocated node and every
request's KV and state layer by layer; float32, so TP 2 and TP 1 compute the same tokens. Any
other flag goes to ``kvtransfer demo``.
"""

import sys

import torch

from kvtransfer import demo


def main() -> int:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"hybrid_tp2_to_tp1: prefill TP 2 needs 2 GPUs (NCCL puts one rank on each); {gpus} visible",
              file=sys.stderr)
        return 2
    args = ["--model", "hybrid-tiny", "--device", "cuda", "--dtype", "float32", "--prefill-tp", "2",
            "--decode-tp", "1", "--prefill-gpu", "0", "--decode-gpu", str(gpus - 1)]
    print(f"{gpus} GPUs: {', '.join(torch.cuda.get_device_name(i) for i in range(gpus))}; prefill ranks on GPUs "
          f"0, 1, decode on GPU {gpus - 1}", flush=True)
    return demo.main(args + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
