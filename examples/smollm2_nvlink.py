"""SmolLM2 on GPUs: prefill on one GPU, decode on another, KV over the NVLink engine (bfloat16).

    python examples/smollm2_nvlink.py                 # prefill on GPU 0, decode on the last GPU
    python examples/smollm2_nvlink.py --prefill-tp 3  # prefill TP 3 on GPUs 0..2 (needs 3 GPUs)

Starts a prefill node, a decode node, the router and a colocated reference node (on the
prefill's GPU), sends real prompts through the router, checks every completion against the
colocated node and every request's KV layer by layer, and prints the transfer figures. With one
GPU both nodes share it (the NVLink engine then copies within the GPU). Any other flag goes to
``kvtransfer demo`` (``--help``).
"""

import sys

import torch

from kvtransfer import demo


def main() -> int:
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("smollm2_nvlink: needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    args = ["--model", "smollm2", "--device", "cuda", "--dtype", "bfloat16", "--transport", "nvlink",
            "--prefill-tp", "1", "--decode-tp", "1", "--prefill-gpu", "0", "--decode-gpu", str(gpus - 1)]
    print(f"{gpus} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(gpus))}; prefill on GPU 0, "
          f"decode on GPU {gpus - 1}", flush=True)
    return demo.main(args + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
