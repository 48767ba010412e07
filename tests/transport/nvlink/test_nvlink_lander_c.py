"""The C steps without a GPU: their driver calls go to a stand-in ``libcuda.so.1``
(``fake_cuda/libcuda.c``). The landers' thread (``native.c``'s ``lander_*``; events are flags
in host memory, the word a real shared word; cases in ``_fake_cuda_lander.py``) and the staged
pipeline and launches (``pipeline``, ``launch``; the calls logged; cases in
``_fake_cuda_pipeline.py``), each run in a fresh Python that loads the stand-in. On a GPU,
``test_nvlink_lander.py`` and ``test_nvlink_staged.py`` run them for real."""

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


def _run(fake_driver, module: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LD_LIBRARY_PATH=f"{fake_driver}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_lander_releases_in_order_withdraws_and_closes(fake_driver):
    done = _run(fake_driver, "tests.transport.nvlink._fake_cuda_lander")
    assert done.returncode == 0 and done.stdout.rstrip().endswith("lander ok"), done.stdout + done.stderr
    for case in ("in order", "withdrawn", "landed by the caller", "failed", "passed", "waited", "grown", "refused", "shared", "closed",
                 "spin", "bell"):
        assert case in done.stdout, done.stdout


def test_the_pipeline_enqueues_every_chunk_in_order_and_stops_at_a_failure(fake_driver):
    done = _run(fake_driver, "tests.transport.nvlink._fake_cuda_pipeline")
    assert done.returncode == 0 and done.stdout.rstrip().endswith("pipeline ok"), done.stdout + done.stderr
    for case in ("pipeline in order", "pipeline failed midway", "pipeline refused", "launch widths"):
        assert case in done.stdout, done.stdout
