"""The C landers' thread (``native.c``'s ``lander_*``) without a GPU: its driver calls go to
a stand-in ``libcuda.so.1`` (``fake_cuda/libcuda.c``: events are flags in host memory), its
word is a real shared word; the cases are in ``_fake_cuda_lander.py``, run in a fresh Python
that loads the stand-in. On a GPU, ``test_nvlink_lander.py`` runs the lander with real events."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.transport._support import ROOT
from transport.nvlink import native

FAKE = Path(__file__).with_name("fake_cuda") / "libcuda.c"


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    try:
        native.build()
    except OSError as exc:
        pytest.skip(f"the C steps cannot be built here: {exc}")
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("fake_cuda")
    subprocess.run([cc, "-O1", "-shared", "-fPIC", str(FAKE), "-o", str(out / "libcuda.so.1")], check=True)
    return out


def test_the_lander_releases_in_order_withdraws_and_closes(fake_driver):
    env = dict(os.environ, LD_LIBRARY_PATH=f"{fake_driver}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-m", "tests.transport._fake_cuda_lander"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("lander ok"), done.stdout + done.stderr
    for case in ("in order", "withdrawn", "landed by the caller", "failed", "passed", "waited", "grown", "refused", "shared", "closed"):
        assert case in done.stdout, done.stdout
