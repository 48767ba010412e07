"""The direct path's host steps in C (``native.c``, with the landers' thread in ``lander.c``),
built at first use and kept.

Why
---
A direct write's host steps -- copy the slots into the pinned ring and check their bounds, queue
their upload, order the copy stream after the caller's, launch -- are a few driver calls; in
Python they cost several times those calls (bench/RESULTS.md). ``native.c`` does the same steps
with the same checks, one call each, and holds the landed word's thread
(:class:`transport.nvlink.landed.Lander`), which stores a notification's number without the
GIL.

How
---
:func:`load` compiles ``native.c`` with the system's C compiler against this Python's headers
(no CUDA headers: it declares the few driver entry points it resolves from ``libcuda.so.1``),
once per source and interpreter, into a cache directory (``~/.cache/kvtransfer/native``, else
the temporary directory), and imports it. A machine without a compiler, the Python headers or
the driver gets None and the reason (:func:`why_unavailable`); the callers then run the same
steps in Python and the progress thread stores the landed word. That second path stays for
correctness, not speed: it is what runs where ``native.c`` cannot be built (no C compiler, no
Python headers, no driver library), and it is the reference the C steps are tested against
(``NvlinkConfig.native`` False chooses it).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional

from transport.nvlink.ipc import CudaIpcError

__all__ = ["build", "load", "why_unavailable"]

log = logging.getLogger(__name__)

_NAME = "_kvt_native"
_SOURCE = Path(__file__).with_name("native.c")
_INCLUDED = (Path(__file__).with_name("lander.c"),)  # #included by native.c: part of the build's key
_lock = threading.Lock()
_loaded: dict = {}  # "module" -> the module with its driver loaded, or "why" -> the reason it is not


def _cache_dirs() -> list[Path]:
    return [Path.home() / ".cache" / "kvtransfer" / "native", Path(tempfile.gettempdir()) / "kvtransfer-native"]


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build() -> ModuleType:
    """The compiled module, imported (built now unless a cached build of this source and this
    interpreter exists). ``OSError`` naming what is missing (a compiler, ``Python.h``) or the
    compiler's message."""
    source = _SOURCE.read_bytes() + b"".join(path.read_bytes() for path in _INCLUDED)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    tag = hashlib.sha256(source + sys.version.encode() + suffix.encode()).hexdigest()[:16]
    for base in _cache_dirs():
        path = base / tag / f"{_NAME}{suffix}"
        if path.exists():
            return _import(path)
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise OSError(f"no Python.h in {include} (install this Python's development headers)")
    errors = []
    for base in _cache_dirs():
        out = base / tag
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=suffix, dir=out)
            os.close(fd)
        except OSError as exc:
            errors.append(f"{out}: {exc}")
            continue
        cmd = [cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(_SOURCE), "-o", tmp, "-ldl", "-pthread"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            os.unlink(tmp)
            raise OSError(f"{' '.join(cmd)} did not finish within 300 s") from None
        if done.returncode != 0:
            os.unlink(tmp)
            raise OSError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        path = out / f"{_NAME}{suffix}"
        os.replace(tmp, path)  # atomic: a process building beside this one reads a whole file
        return _import(path)
    raise OSError("no writable cache directory: " + "; ".join(errors))


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> Optional[ModuleType]:
    """The module with the CUDA driver's entry points loaded, built at the first call; None (and
    :func:`why_unavailable` says why) when it cannot be built or there is no driver. Its driver
    errors raise :class:`~transport.nvlink.ipc.CudaIpcError`. The answer is kept for the
    process."""
    with _lock:
        if not _loaded:
            try:
                ctypes.CDLL("libcuda.so.1")
            except OSError as exc:  # no driver, nothing to build for (no GPU path runs here)
                _loaded["why"] = str(exc)
                return None
            try:
                module = build()
                module.load_driver()
                module.set_error_class(CudaIpcError)  # as the Python steps' failures
                _loaded["module"] = module
            except (OSError, ImportError) as exc:  # a GPU machine that cannot build or load it: say so once, run the Python steps
                _loaded["why"] = str(exc)
                log.warning("nvlink: the direct path's host steps run in Python (slower by tens of "
                            "microseconds per write): %s", exc)
        return _loaded.get("module")


def why_unavailable() -> Optional[str]:
    """Why :func:`load` returned None (None: it did not, or was not called)."""
    return _loaded.get("why")
