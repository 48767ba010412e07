import os

import pytest
import torch


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# Where the tests that start processes live (most of the suite's time): collected first, so
# that on two workers (`./dev test`, a file's tests on one worker) the long files start early
# and the workers end together. The order is otherwise the files' own.
_LONG_FIRST = ("tests/kvtransfer/serve/", "tests/kvtransfer/benchmarks/test_bench_serve.py",
               "tests/kvtransfer/control/", "tests/e2e/", "tests/kvtransfer/models/")


def _start_rank(item) -> int:
    return next((i for i, prefix in enumerate(_LONG_FIRST) if item.nodeid.startswith(prefix)), len(_LONG_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_rank)  # stable
    n = _gpu_count()
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


# Loopback transport tests stay on 127.0.0.1 over tcp (NIXL refuses shm-only transports).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_TLS", "tcp,self,sm")
