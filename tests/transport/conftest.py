"""Fixtures shared by the transport tests (helpers: ``_support.py``)."""

from __future__ import annotations

import pytest

from tests.transport._support import Receiver, Writer


@pytest.fixture(scope="module")
def remote():
    """A receiver process on cuda:1 with nvlink-registered buffers (GPU tests only)."""
    from kvtransfer.benchmarks._remote import RemoteBuffers

    r = RemoteBuffers(device=1)
    yield r
    r.close()


@pytest.fixture
def remote_any():
    """A receiver process with nvlink-registered buffers on cuda:1, or on cuda:0 beside the
    writer when there is one GPU (GPU tests only): the bytes cross NVLink or stay in the GPU,
    the host steps are the same."""
    import torch

    from kvtransfer.benchmarks._remote import RemoteBuffers

    r = RemoteBuffers(device=min(1, torch.cuda.device_count() - 1))
    yield r
    r.close()


@pytest.fixture
def receiver():
    """A factory of NIXL receiver processes (:class:`Receiver`), stopped at teardown."""
    started = []

    def start(sizes, env=None, cuda_device=None, staged=None, progress_thread=False):
        r = Receiver(sizes, env, cuda_device, staged, progress_thread)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


@pytest.fixture
def writer(monkeypatch):
    """A factory of writing NIXL transports, closed at teardown; ``env`` overrides UCX variables."""
    from transport.nixl import NixlConfig, NixlTransport

    made = []

    def make(env=None, **config):
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        t = NixlTransport(NixlConfig(**config))
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


@pytest.fixture
def writer_proc():
    """A factory of writer processes (:class:`Writer`; NIXL unless ``backend`` says), stopped at teardown."""
    started = []

    def start(seed, nbytes, env=None, backend="nixl", device=None):
        w = Writer(seed, nbytes, env, backend, device)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()
