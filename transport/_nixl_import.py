"""Lazy import of NIXL's Python API (``nixl_agent`` and friends).

NIXL ships per CUDA major version: ``nixl`` (meta package), ``nixl-cu13`` and ``nixl-cu12``
on PyPI; each installs a different top-level module. We try them in that order on first use
so that importing :mod:`transport` never needs NIXL (the ``nvlink`` backend does not).

Before NIXL loads, the host's own ``libnl-route-3.so.200`` (if any) is loaded on its own
(:func:`_load_host_libnl_route`): see there why a process with NIXL otherwise dies with
SIGSEGV at exit on hosts with libibverbs.
"""

from __future__ import annotations

import ctypes
import importlib
from types import ModuleType
from typing import Optional

# Module names tried in order; the first that imports wins.
CANDIDATES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")

_api: Optional[ModuleType] = None


# The host's libnl-route (rdma-core's libibverbs.so.1 links it): see _load_host_libnl_route.
HOST_LIBNL_ROUTE = "libnl-route-3.so.200"
_host_libnl_route: Optional[ctypes.CDLL] = None


def _load_host_libnl_route() -> None:
    """Load the host's libnl-route-3 in a symbol scope of its own, before NIXL's UCX loads.

    NIXL's wheels bundle UCX with renamed copies of libibverbs and libnl-route-3 (same symbol
    names). UCX's ``libuct_ib_efa`` module also needs the host's ``libefa.so.1`` (package
    ibverbs-providers), which pulls in the host's ``libibverbs.so.1`` and ``libnl-route-3.so.200``:
    a second libnl-route in the same dlopen group, listed after the bundled one, so its calls
    bind to the bundled copy. Its constructors' ``rtnl_tc_register`` then finds each traffic
    control kind ("tbf", ...) already registered there and leaves the host copy's entries
    unlinked, and at exit (``_dl_fini``, after Python has finished) the host copy's destructors
    call ``rtnl_tc_unregister`` on those entries, whose list pointers are NULL: SIGSEGV, exit
    status 139, whatever was released before. Loaded first, with RTLD_LOCAL, the host copy
    binds to itself, the bundled copy to itself, and both unload cleanly. Absent (no
    libibverbs on the host), nothing is loaded and nothing needs to be.
    """
    global _host_libnl_route
    if _host_libnl_route is not None:
        return
    try:
        _host_libnl_route = ctypes.CDLL(HOST_LIBNL_ROUTE, mode=ctypes.RTLD_LOCAL)
    except OSError:  # not installed: only NIXL's bundled copy will be loaded
        pass


def load_nixl_api() -> ModuleType:
    """Return NIXL's ``_api`` module, importing it on first call.

    Raises ImportError naming the pip extras to install when no variant is importable.
    """
    global _api
    if _api is not None:
        return _api
    _load_host_libnl_route()
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
