"""Host staging that the two sides of a lane share when they run on one host.

On one host, NIXL's write of a staged chunk is one more copy of every byte (UCX's cma: the
writer's kernel copies the sender's slot into the receiver's), on the cores that also gather
and scatter: three copies against the one of a direct write of large blocks
(docs/notes/nixl.md). So a receiver on the sender's host -- the same boot, network namespace
and PID namespace (:func:`host_key`: two "hosts" made of network namespaces stay apart) --
allocates its host slots in a memfd and names it in its Welcome as ``(pid, fd)``; the sender
maps it through ``/proc/<pid>/fd/<fd>``, gathers each chunk straight into the receiver's slot
and sends the chunk's notification alone (a one-byte write carrying it). The receiver does
what it always does when that notification comes: it checks the chunk's header and rows,
scatters them into its owner's regions and answers a Credit. So the contract holds as before:
the rows reach the owner's memory only through the receiver's scatter, after its checks, and
an abort waits for the Credits of every chunk posted. A sender that cannot map the memory
(another user, a /proc it may not read) writes the slots through NIXL as before: they stay
registered.
"""

from __future__ import annotations

import functools
import mmap
import os
from typing import Optional

import numpy as np

from transport.nixl.staged.copy import HostStaging, Staging

__all__ = ["SharedHostStaging", "host_key"]


@functools.lru_cache(maxsize=1)
def host_key() -> str:
    """What two processes must share to share staging memory: the boot (``boot_id``), the
    network namespace and the PID namespace (a pid names the same process on both sides);
    "" when this system does not say (no shared staging then)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


class SharedHostStaging(HostStaging):
    """Host staging in a memfd: made here (``owner`` None: the receiver's, :attr:`shared` says
    how to reach it), or the receiver's memfd ``owner`` = ``(pid, fd)`` mapped here (the
    sender's); OSError or ValueError when it cannot be mapped."""

    def __init__(self, slots: int, slot_bytes: int, owner: Optional[tuple[int, int]] = None):
        Staging.__init__(self, slots, slot_bytes)
        if owner is None:
            fd = os.memfd_create("kvtransfer-staging", os.MFD_CLOEXEC)
        else:
            pid, num = owner
            fd = os.open(f"/proc/{int(pid)}/fd/{int(num)}", os.O_RDWR | os.O_CLOEXEC)
        try:
            if owner is None:
                os.ftruncate(fd, self.nbytes)
            elif os.fstat(fd).st_size != self.nbytes:
                raise ValueError(f"the receiver's staging holds {os.fstat(fd).st_size} bytes, not {self.nbytes}")
            self._map = mmap.mmap(fd, self.nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.buf = np.frombuffer(self._map, dtype=np.uint8)  # [slots * slot_bytes]
        if owner is None:
            self.buf[:] = 0  # its pages exist before the first chunk
        self.ptr = self.buf.ctypes.data
        if owner is None:
            self.shared = (os.getpid(), fd)  # a Welcome's ``shared``: how the sender finds it

    def close(self) -> None:
        """Unmap (the memory goes once the other side has unmapped it too) and close the fd."""
        if self.fd < 0:
            return
        self.buf = None
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive: the mapping goes with the last one
            pass
        os.close(self.fd)
        self.fd = -1
