"""The NIXL backend's staged mode: many small ranges as a few large writes.

Why
---
NIXL (UCX) pays per range: a TP change or page size 1 cuts a request into one range per
(layer, token, head slice), and 65,536 ranges of 1 KiB move at a few percent of what the same
bytes move at as 256 KiB blocks (bench/RESULTS.md). So for a batch of many small ranges the
sender packs the ranges, the wire carries large writes, and the receiver unpacks.

How (one lane per pair of transports: :mod:`~transport.nixl.staged.lane` and its jobs,
:mod:`~transport.nixl.staged.sender`, on the sending side; :mod:`~transport.nixl.staged.receiver`)
-------------------------------------------------------------------------------------------------
1. At the first staged write to a peer, the sender allocates and registers its staging
   (``slots`` x ``slot_bytes``) and sends a Hello (its NIXL metadata) in a notification; the
   receiver allocates and registers the same on the batch's destination memory, loads the
   sender's metadata and answers Welcome (its staging address and refreshed metadata) with
   ``send_notif``. Allocated once per peer, kept until the transport closes.
2. Rows are cut into chunks that fit a slot. For each free slot: *gather* the chunk's rows
   into it (host: vectorised torch / numpy copies; CUDA: the NVLink backend's Triton row
   kernel in its gather mode; :mod:`~transport.nixl.staged.copy`), write its header and row
   table in front, and post ONE NIXL write of the slot into the receiver's slot, its
   notification naming the chunk. Slots rotate, so the gather of one chunk, the wire of the
   previous and the receiver's scatter of the one before overlap.
3. The receiver, in ``poll_notifications()``, checks the chunk's rows against its own
   registered regions, *scatters* them, answers a Credit (the slot is free) and, once every
   chunk of the write is scattered, hands the write's notification to its owner.

On one host (:mod:`~transport.nixl.staged.shared`: same boot, network and PID namespaces;
host memory on both sides) the receiver's slots are a memfd the sender maps: the sender
gathers each chunk straight into the receiver's free slot and posts its notification alone
(one byte), driving NIXL until it has left; NIXL's copy of the slot (a cma copy on the sender's
core) is gone. Steps 1 and 3 are unchanged; a sender that cannot map the memfd writes the
slots through NIXL.

The contract (:mod:`transport.base`) holds: a notification means the bytes are in place;
``abort()`` posts nothing more and returns once the receiver answered every chunk posted
(it scatters before it answers), so no byte lands after it returns; a dead or stalled
receiver fails the write at its deadline (``NixlConfig.deadline_s``) and the agent is lost
(requests still in flight drain before a new ``connect``), as for direct writes. One
sender's notifications keep their order: a direct write issued while a staged one is still
posting queues behind it.

Strided writes (``NixlPeer.write_strided``: P buffer pairs x S slots, a KV request's natural
form) take the same road with host work O(P + S) per write instead of O(rows): a chunk is a
range of the pair-major rows, cut in O(P); the sender gathers it in one step per pair part
(host) or one launch of the NVLink strided kernel in its GATHER mode (CUDA, the write's table
uploaded once); each slot carries the write's destination table (P pairs, S slots: 32 P + 8 S
bytes, 0.1 % of a 128 MiB slot for 160 x 16,384) instead of a row table; the receiver checks the
table once per write (O(P + S), against its own regions) and scatters each chunk in one step
(:mod:`~transport.nixl.staged.wire`, :mod:`~transport.nixl.staged.copy`).

When (``StagedNixlConfig.wants``): at least ``min_rows`` ranges, none longer than
``max_row_bytes``, all sources on one memory (host or one GPU) and all destinations on one;
else the write goes direct. One lane per remote agent: its memory kinds are those of the
first staged write; a write of other kinds goes direct.

Costs
-----
- Memory: ``slots`` x the slot size registered bytes per lane on EACH side (a lane sharing
  the receiver's slots: on the receiver only), on the batch's memory (host or GPU): 4 x 4 MiB = 16 MiB for lanes into host memory, 4 x 128 MiB = 512 MiB
  for lanes into a GPU (``cuda_slot_bytes``); a receiver keeps at most ``max_lanes`` host and
  ``max_cuda_lanes`` GPU lanes (``StagedNixlConfig``).
- Bytes: 16 bytes of row table per range on the wire (1.6 % for 1 KiB rows, 6 % for 256 B);
  a strided write's table, ``32 P + 8 S`` bytes, per chunk.
- Time: a Hello / Welcome round trip at the first staged write to a peer; host copies run on
  the owner's thread (the sender's gather in ``status()``/``wait()``, the receiver's scatter
  in ``poll_notifications()``): staged writes progress only while the receiver polls, as
  direct writes over tcp already do.
- The receiver loads each staged sender's metadata (a UCX endpoint back to it, for the
  answers); payloads starting with ``wire.MAGIC`` are reserved.
"""

from transport.nixl.staged.config import StagedNixlConfig

__all__ = ["StagedNixlConfig"]
