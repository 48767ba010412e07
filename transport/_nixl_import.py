"""Lazy import of NIXL's Python API (``nixl_agent`` and friends).

NIXL ships per CUDA major version: ``nixl`` (meta package), ``nixl-cu13`` and ``nixl-cu12``
on PyPI; each installs a different top-level module. We try them in that order on first use
so that importing :mod:`transport` never needs NIXL (the ``nvlink`` backend does not).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

# Module names tried in order; the first that imports wins.
CANDIDATES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")

_api: Optional[ModuleType] = None


def load_nixl_api() -> ModuleType:
    """Return NIXL's ``_api`` module, importing it on first call.

    Raises ImportError naming the pip extras to install when no variant is importable.
    """
    global _api
    if _api is not None:
        return _api
    errors = []
    for name in CANDIDATES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # not installed, or installed for another CUDA
            errors.append(f"{name}: {exc}")
            continue
        _api = module
        return module
    raise ImportError(
        "the nixl transport needs NVIDIA NIXL; install the variant that matches the machine's "
        "CUDA major version: `pip install 'kvtransfer[nixl-cu12]'` (CUDA 12) or "
        "`pip install 'kvtransfer[nixl-cu13]'` (CUDA 13); a CPU-only machine can use either. "
        "Tried: " + "; ".join(errors)
    )
