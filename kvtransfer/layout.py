"""What one rank's pools look like, in bytes: the input of the transfer planner.

A :class:`RankLayout` is a frozen, msgpack-able description of one rank's KV pool (and
optional state pool). It travels in the handshake; the planner (``kvtransfer.plan``) turns
two of them plus a request's slots into byte ranges. The pools' enums (``KVKind``,
``StateKind``, ``ShardRule``, from ``pools.describe``) are the only thing taken from them: build
a layout with :meth:`RankLayout.from_pools` (which reads what each pool says it holds, its
``transfer_layout()``, see ``pools.describe``) or with the explicit builders
:meth:`RankLayout.attention` / :meth:`RankLayout.with_mamba` / :meth:`RankLayout.with_nsa_index`.

Buffers are numbered as the pools export them. Every export is "tensor-major, then layer":
buffer ``export_index * num_layers + layer_position`` (MHA ``[K_0..K_{L-1}, V_0..V_{L-1}]``,
FP4 adds ``[Kscale.., Vscale..]``, MLA ``[KV_0..]``, Mamba ``[conv_0[l].., conv_1[l].., temporal[l]..]``).

A :class:`TensorSpec` describes one exported tensor kind (or one section of it): the bytes of
one slot row on this rank and how the full (unsharded) row is cut across TP ranks:

- ``REPLICATED``: every rank holds the whole row (MLA latent KV, NSA index_k).
- ``HEADS``: the row is ``total_heads`` heads of ``unit_bytes``, cut by :func:`shard_units`
  (the one TP sharding rule). FP4 scale rows are heads too (``head_dim // 16`` bytes per head).
- ``GROUPS``: the row is sub-blocks (Mamba conv ``[x | B | C]`` or ``[q | k | v]`` channels,
  each channel ``(K-1) * itemsize`` bytes; the temporal state is one block of heads). Each
  sub-block is cut on its own, by whole units (a channel, or a Mamba2 group of ``state``
  channels, replicated when TP exceeds the groups), and the rank's row is the concatenation
  of its shards. See :class:`TensorSpec`.

Slot ``s`` of a buffer starts at ``(s // page_size) * page_bytes + section_start +
(s % page_size) * row_bytes``; for an ordinary buffer (``page_bytes == page_size * row_bytes``,
``section_start == 0``) that is ``s * row_bytes``. NSA's index_k buffer has two sections per
page (``page_size`` fp8 rows, then ``page_size`` fp32 scales), described by two specs that
share one ``export_index``.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, fields
from typing import Optional, Sequence

import msgpack

from pools.describe import KVKind, ShardRule, StateKind

__all__ = [
    "LAYOUT_VERSION",
    "LayoutMismatch",
    "KVKind",
    "RankLayout",
    "ShardRule",
    "StateKind",
    "TensorSpec",
    "UnitShard",
    "dtype_itemsize",
    "shard_units",
]

LAYOUT_VERSION = 1

_ITEMSIZE = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "uint8": 1, "int8": 1,
    "int32": 4, "int64": 8, "float4_e2m1fn_x2": 1,  # two FP4 values per byte
}
FP4_BLOCK = 16  # elements per FP4 scale byte
NSA_QUANT_BLOCK = 128  # index_k elements per fp32 scale


class LayoutMismatch(ValueError):
    """Two layouts cannot exchange data; the message names the field and both values."""


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a dtype name such as ``"bfloat16"`` (``torch.`` prefix allowed)."""
    key = str(name).removeprefix("torch.")
    if key not in _ITEMSIZE:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_ITEMSIZE)}")
    return _ITEMSIZE[key]


@dataclass(frozen=True)
class UnitShard:
    """The units (heads, channels, groups) one TP rank holds: ``[first, first + count)``, the
    same on ``replicas`` consecutive ranks (a block of ranks starting at a multiple of it)."""

    first: int
    count: int
    replicas: int

    @property
    def units(self) -> range:
        return range(self.first, self.first + self.count)


def shard_units(units: int, tp_rank: int, tp_size: int) -> UnitShard:
    """The TP sharding rule, for every sharded thing (KV heads, Mamba channels and groups).

    With TP ``T <= units`` rank ``r`` holds units ``[r*n/T, (r+1)*n/T)``; with ``T > units``
    the units are replicated and rank ``r`` holds unit ``r // (T // units)``. ``units`` and
    ``T`` must divide one another (ValueError otherwise).
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if units % tp_size and tp_size % units:
        raise ValueError(f"{units} units and TP size {tp_size} must divide one another")
    if tp_size <= units:  # split: each rank its own range
        per = units // tp_size
        return UnitShard(tp_rank * per, per, 1)
    replicas = tp_size // units  # replicated: consecutive ranks share a unit
    return UnitShard(tp_rank // replicas, 1, replicas)


def _pos_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """One exported tensor kind (repeated per layer), or one section of its pages.

    The full (unsharded) row is sub-blocks ``groups = ((units, channels_per_unit), ...)`` of
    channels of ``unit_bytes``; each sub-block is cut on its own by whole units, by
    :func:`shard_units`. HEADS is one sub-block of ``(total_heads, 1)`` (a channel is a
    head); REPLICATED is ``((1, 1),)`` (a channel is the row); a Mamba conv tensor is e.g.
    ``((intermediate, 1), (n_groups, state), (n_groups, state))``.
    """

    name: str
    export_index: int
    shard: ShardRule
    row_bytes: int  # this rank's bytes per slot row of this section
    unit_bytes: int  # bytes of one channel (a head, a conv channel; the row for REPLICATED)
    groups: tuple  # ((units, channels_per_unit), ...) per sub-block, unsharded
    page_bytes: int  # bytes per page of the buffer (the pool's item_len)
    section_start: int = 0  # bytes from a page's start to this section

    @property
    def full_row_bytes(self) -> int:
        """Bytes of the unsharded row (the same on every rank of every TP size)."""
        return sum(n * c for n, c in self.groups) * self.unit_bytes

    def local_channels(self, tp_size: int) -> int:
        """Channels one rank holds at TP ``tp_size`` (raises if a sub-block cannot be cut)."""
        return sum(self._shard(n, 0, tp_size).count * c for n, c in self.groups)

    def pieces(self, tp_rank: int, tp_size: int) -> list:
        """``[(logical_start, length, physical_start, replicas)]`` in bytes, one per sub-block:
        where this rank's row comes from in the full row; ``replicas`` consecutive ranks (a
        block starting at a multiple of it) hold that same piece."""
        u, out, logical, phys = self.unit_bytes, [], 0, 0
        for n, c in self.groups:
            held = self._shard(n, tp_rank, tp_size)
            out.append((logical + held.first * c * u, held.count * c * u, phys, held.replicas))
            logical += n * c * u
            phys += held.count * c * u
        return out

    def _shard(self, units: int, tp_rank: int, tp_size: int) -> UnitShard:
        """:func:`shard_units` of one sub-block; a TP that cannot cut it is a LayoutMismatch
        naming this tensor."""
        try:
            return shard_units(units, tp_rank, tp_size)
        except ValueError as exc:
            if not 0 <= tp_rank < tp_size:
                raise
            if self.shard is ShardRule.HEADS:
                raise LayoutMismatch(
                    f"{self.name}: total heads {units} and TP size {tp_size} must divide one another") from exc
            raise LayoutMismatch(f"{self.name}: every sub-block's units must divide TP size {tp_size} or be "
                                 f"divided by it, got (units, size) groups {_show(self.groups)}") from exc

    def check_consistent(self, tp_size: int, page_size: int) -> None:
        """Raise :class:`LayoutMismatch` when the spec contradicts itself at TP ``tp_size``
        (a decoded peer layout is trusted only after this): ``row_bytes`` must be the rank's
        channels x ``unit_bytes``, and ``page_size`` rows from ``section_start`` must fit
        ``page_bytes``."""
        for name in ("unit_bytes", "page_bytes"):
            _pos_int(f"{self.name}.{name}", getattr(self, name))
        if not isinstance(self.section_start, int) or self.section_start < 0:
            raise LayoutMismatch(f"{self.name}: section_start must be an int >= 0, got {self.section_start!r}")
        if not self.groups or not all(len(g) == 2 and all(isinstance(x, int) and x > 0 for x in g)
                                      for g in self.groups):
            raise LayoutMismatch(f"{self.name}: groups must be (units, channels) pairs of positive ints, "
                                 f"got {_show(self.groups)}")
        want = self.local_channels(tp_size) * self.unit_bytes  # raises when this TP cannot cut it
        if self.row_bytes != want:
            raise LayoutMismatch(f"{self.name}: row_bytes {self.row_bytes!r} contradicts its groups "
                                 f"{_show(self.groups)} x unit_bytes {self.unit_bytes} at TP {tp_size} ({want})")
        if self.section_start + page_size * self.row_bytes > self.page_bytes:
            raise LayoutMismatch(f"{self.name}: {page_size} rows of {self.row_bytes} B from byte "
                                 f"{self.section_start} do not fit its page of {self.page_bytes} B")

    def to_wire(self) -> dict:
        d = asdict(self)
        d["shard"] = self.shard.value
        d["groups"] = [list(g) for g in self.groups]
        return d

    @classmethod
    def from_wire(cls, d) -> "TensorSpec":
        if not isinstance(d, dict):
            raise LayoutMismatch(f"tensor spec must be a map, got {type(d).__name__}")
        d = dict(d)
        d["shard"] = ShardRule(d["shard"])
        d["groups"] = tuple(tuple(g) for g in d["groups"])
        return cls(**d)


def _spec(name, index, shard, unit_bytes, groups, tp_size, page_size, section=(0, None)) -> TensorSpec:
    """A spec whose row is the rank's shard; ``section`` = (start, page_bytes) for sectioned pages."""
    groups = tuple(tuple(g) for g in groups)
    row = TensorSpec(name, index, shard, 0, unit_bytes, groups, 0).local_channels(tp_size) * unit_bytes
    start, page_bytes = section
    return TensorSpec(name, index, shard, row, unit_bytes, groups,
                      page_size * row if page_bytes is None else page_bytes, start)


@dataclass(frozen=True)
class RankLayout:
    """One rank's pools. See the module docstring for buffer numbering and addressing."""

    kind: KVKind
    tp_rank: int
    tp_size: int
    page_size: int
    layer_ids: tuple  # global layer ids, in export order
    dtype: str  # logical dtype name (fp8 pools store uint8; FP4 pools pack 2 per byte)
    head_dim: int  # MHA K head dim; MLA/NSA: the latent row width (kv_lora_rank + rope)
    v_head_dim: int
    total_heads: int  # total KV heads over all TP ranks (MLA: 1)
    num_slots: int  # token rows of each KV buffer (size + page_size); page 0 is padding
    kv_tensors: tuple  # TensorSpec per exported tensor kind, in export order
    state_kind: StateKind = StateKind.NONE
    state_layer_ids: tuple = ()
    state_page_size: int = 1
    state_num_slots: int = 0  # slot rows of each state buffer; slot 0 (page 0) is padding
    state_tensors: tuple = ()
    state_dims: tuple = ()  # get_state_dim_per_tensor() per state tensor kind (TP-sliced dim)
    conv_shard_groups: tuple = ()  # per conv tensor: its sub-blocks as (units, size) pairs, unsharded

    def __post_init__(self):
        for name in ("layer_ids", "state_layer_ids", "state_dims", "kv_tensors", "state_tensors"):
            object.__setattr__(self, name, tuple(getattr(self, name)))  # hashable: plans cache per layout pair
        object.__setattr__(self, "conv_shard_groups",
                           tuple(tuple(tuple(p) for p in g) for g in self.conv_shard_groups))
        for name in ("tp_size", "page_size", "num_slots", "head_dim", "v_head_dim", "total_heads",
                     "state_page_size"):
            _pos_int(name, getattr(self, name))
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids must be non-empty and distinct, got {list(self.layer_ids)}")
        dtype_itemsize(self.dtype)
        for spec in self.kv_tensors + self.state_tensors:
            if not isinstance(spec, TensorSpec):
                raise TypeError(f"tensor specs must be TensorSpec, got {type(spec).__name__}")
        for spec in self.kv_tensors:
            spec.check_consistent(self.tp_size, self.page_size)
        for spec in self.state_tensors:
            spec.check_consistent(self.tp_size, self.state_page_size)
        if self.state_kind is not StateKind.NONE and not (self.state_tensors and self.state_layer_ids):
            raise ValueError(f"state kind {self.state_kind.value} needs state tensors and layer ids")

    def __hash__(self) -> int:
        """The fields' hash, computed once: plans are cached per layout pair, and hashing every
        field (tuples of specs) cost more than the rest of a small request's plan."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        """Pickled without the cached hash (another process hashes strings differently)."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    # -- numbering -------------------------------------------------------------------
    @property
    def num_kv_buffers(self) -> int:
        return len({s.export_index for s in self.kv_tensors}) * len(self.layer_ids)

    @property
    def num_state_buffers(self) -> int:
        return len({s.export_index for s in self.state_tensors}) * len(self.state_layer_ids)

    @property
    def is_hybrid(self) -> bool:
        return self.state_kind is StateKind.MAMBA

    # -- builders --------------------------------------------------------------------
    @classmethod
    def attention(
        cls, kind: KVKind, *, tp_rank: int, tp_size: int, page_size: int, layer_ids: Sequence[int],
        dtype: str, head_dim: int, num_slots: int, total_heads: int = 1, v_head_dim: Optional[int] = None,
    ) -> "RankLayout":
        """The KV part of a layout. ``head_dim`` of MLA/NSA is the latent row width;
        ``total_heads`` counts KV heads over all TP ranks (MHA only)."""
        kind = KVKind(kind)
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        isz = dtype_itemsize(dtype)
        heads, ps = ShardRule.HEADS, page_size
        if kind is KVKind.MHA:
            specs = [_spec("k", 0, heads, head_dim * isz, ((total_heads, 1),), tp_size, ps),
                     _spec("v", 1, heads, v_head_dim * isz, ((total_heads, 1),), tp_size, ps)]
        elif kind is KVKind.MHA_FP4:
            specs = [_spec("k", 0, heads, head_dim // 2, ((total_heads, 1),), tp_size, ps),
                     _spec("v", 1, heads, v_head_dim // 2, ((total_heads, 1),), tp_size, ps),
                     _spec("k_scale", 2, heads, head_dim // FP4_BLOCK, ((total_heads, 1),), tp_size, ps),
                     _spec("v_scale", 3, heads, v_head_dim // FP4_BLOCK, ((total_heads, 1),), tp_size, ps)]
        elif kind is KVKind.MLA_FP4:
            rep = ShardRule.REPLICATED
            specs = [_spec("kv", 0, rep, head_dim // 2, ((1, 1),), tp_size, ps),
                     _spec("kv_scale", 1, rep, head_dim // FP4_BLOCK, ((1, 1),), tp_size, ps)]
        else:  # MLA, NSA: one latent row per token, replicated across TP
            specs = [_spec("kv", 0, ShardRule.REPLICATED, head_dim * isz, ((1, 1),), tp_size, ps)]
        if kind in (KVKind.MHA_FP4, KVKind.MLA_FP4) and head_dim % (2 * FP4_BLOCK):
            raise ValueError(f"FP4 needs head_dim divisible by {2 * FP4_BLOCK}, got {head_dim}")
        if kind not in (KVKind.MHA, KVKind.MHA_FP4):
            total_heads = 1
        return cls(kind, tp_rank, tp_size, page_size, tuple(layer_ids), str(dtype).removeprefix("torch."),
                   head_dim, v_head_dim, total_heads, num_slots, tuple(specs))

    def with_mamba(
        self, *, layer_ids: Sequence[int], num_slots: int, conv_dims: Sequence[int], conv_unit_bytes: Sequence[int],
        temporal_heads: int, temporal_head_bytes: int, conv_shard_groups=None,
    ) -> "RankLayout":
        """Add Mamba state: per conv tensor ``[layers, slots, conv_dims[i], K-1]`` (this rank's
        dims; a channel is ``conv_unit_bytes[i]`` bytes), then temporal ``[layers, slots,
        temporal_heads, head_dim, state]`` (this rank's heads; a head is ``temporal_head_bytes``).

        ``conv_shard_groups`` lists the unsharded sub-blocks of a conv tensor's channels, each
        cut on its own: an int ``c`` is ``c`` channels split evenly; a tuple ``(units, size)``
        is ``units`` blocks of ``size`` channels cut by whole blocks and replicated when TP >
        units (Mamba2 groups: ``[intermediate, (n_groups, state), (n_groups, state)]``). One
        list applies to every conv tensor; a list of lists gives one per conv tensor; None is
        one evenly split block per tensor.
        """
        t = self.tp_size
        if len(conv_dims) != len(conv_unit_bytes):
            raise ValueError(f"conv_dims and conv_unit_bytes differ in length: {len(conv_dims)} vs {len(conv_unit_bytes)}")
        groups = _conv_groups(conv_shard_groups, conv_dims, t)
        specs = []
        for i, (dim, unit, grp) in enumerate(zip(conv_dims, conv_unit_bytes, groups)):
            spec = _spec(f"conv{i}", i, ShardRule.GROUPS, unit, grp, t, 1)
            if spec.row_bytes != dim * unit:
                raise ValueError(_conv_mismatch(i, grp, spec.row_bytes // unit, t, dim))
            specs.append(spec)
        specs.append(_spec("temporal", len(conv_dims), ShardRule.GROUPS, temporal_head_bytes,
                           ((temporal_heads * t, 1),), t, 1))
        return _replace(self, state_kind=StateKind.MAMBA, state_layer_ids=tuple(layer_ids), state_page_size=1,
                        state_num_slots=num_slots, state_tensors=tuple(specs),
                        state_dims=tuple(conv_dims) + (temporal_heads,), conv_shard_groups=groups)

    def with_nsa_index(self, *, index_head_dim: int, num_pages: int) -> "RankLayout":
        """Add NSA's index_k buffers (one per KV layer, paged like the KV): a page is
        ``page_size`` fp8 rows of ``index_head_dim`` bytes, then ``page_size`` fp32 scales."""
        ps = self.page_size
        scale = index_head_dim // NSA_QUANT_BLOCK * 4
        page = ps * (index_head_dim + scale)
        rep = ShardRule.REPLICATED
        specs = (_spec("index_k", 0, rep, index_head_dim, ((1, 1),), self.tp_size, ps, (0, page)),
                 _spec("index_k_scale", 0, rep, scale, ((1, 1),), self.tp_size, ps, (ps * index_head_dim, page)))
        return _replace(self, state_kind=StateKind.NSA_INDEX, state_layer_ids=self.layer_ids, state_page_size=ps,
                        state_num_slots=num_pages * ps, state_tensors=specs, state_dims=(index_head_dim,))

    @classmethod
    def from_pools(cls, kv_pool, state_pool=None, *, tp_rank: int, tp_size: int,
                   total_kv_heads: Optional[int] = None, conv_shard_groups=None) -> "RankLayout":
        """Describe real pools from what they say they hold (``transfer_layout()``, plain data
        defined in ``pools.describe``): no guessing, so a new pool kind needs no edit here.

        ``kv_pool``: any pool whose description has KV buffers (MHA / MHA-FP4 / MLA / MLA-FP4 /
        NSA, whose index_k is its state; a HybridLinearKVPool brings its Mamba state too).
        ``state_pool``: a MambaPool or HybridReqToTokenPool when the state lives there (it wins
        over the kv_pool's). The description is this rank's; what it does not know comes from
        the caller: ``total_kv_heads`` (required when heads are replicated, TP > KV heads;
        default ``heads * tp_size``) and ``conv_shard_groups`` (the sub-blocks of the tensors
        the model cuts, as in :meth:`with_mamba`). The exports are cross-checked against the
        description: an ``item_len`` or ``data_len`` that disagrees raises :class:`LayoutMismatch`.
        """
        return _from_pools(kv_pool, state_pool, tp_rank, tp_size, total_kv_heads, conv_shard_groups)

    # -- compatibility ---------------------------------------------------------------
    def check_compatible(self, peer: "RankLayout") -> None:
        """Raise :class:`LayoutMismatch` naming the first field that cannot work, with both
        values. TP size/rank, page size and slot counts may differ."""
        if not isinstance(peer, RankLayout):
            raise TypeError(f"peer must be a RankLayout, got {type(peer).__name__}")
        for name in ("kind", "dtype", "head_dim", "v_head_dim", "total_heads", "layer_ids", "state_kind",
                     "state_layer_ids", "conv_shard_groups"):
            mine, theirs = getattr(self, name), getattr(peer, name)
            if mine != theirs:
                raise LayoutMismatch(f"layouts differ in {name}: this side {_show(mine)}, peer {_show(theirs)}")
        for part in ("kv_tensors", "state_tensors"):
            a, b = getattr(self, part), getattr(peer, part)
            if [s.name for s in a] != [s.name for s in b]:
                raise LayoutMismatch(f"layouts differ in {part}: this side {[s.name for s in a]}, "
                                     f"peer {[s.name for s in b]}")
            for x, y in zip(a, b):
                for attr in ("shard", "unit_bytes", "groups", "full_row_bytes"):
                    if getattr(x, attr) != getattr(y, attr):
                        raise LayoutMismatch(f"tensor {x.name} differs in {attr}: this side "
                                             f"{_show(getattr(x, attr))}, peer {_show(getattr(y, attr))}")

    # -- wire ------------------------------------------------------------------------
    def to_msgpack(self) -> bytes:
        body = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, enum.Enum):
                v = v.value
            elif f.name in ("kv_tensors", "state_tensors"):
                v = [s.to_wire() for s in v]
            elif f.name == "conv_shard_groups":
                v = [[list(p) for p in g] for g in v]
            elif isinstance(v, tuple):
                v = list(v)
            body[f.name] = v
        return msgpack.packb({"version": LAYOUT_VERSION, "layout": body}, use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> "RankLayout":
        try:
            msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise LayoutMismatch(f"layout bytes are not valid msgpack: {exc}") from exc
        if not isinstance(msg, dict) or msg.get("version") != LAYOUT_VERSION:
            got = msg.get("version") if isinstance(msg, dict) else type(msg).__name__
            raise LayoutMismatch(f"layout version must be {LAYOUT_VERSION}, got {got!r}")
        if not isinstance(msg.get("layout"), dict):
            raise LayoutMismatch(f"layout message must carry a 'layout' map, got {type(msg.get('layout')).__name__}")
        body = dict(msg["layout"])
        expected = {f.name for f in fields(cls)}
        if set(body) != expected:
            raise LayoutMismatch(f"layout fields must be {sorted(expected)}, got {sorted(map(str, body))}")
        try:  # well-formed msgpack of the wrong shape: a LayoutMismatch, never a KeyError/TypeError
            body["kind"] = KVKind(body["kind"])
            body["state_kind"] = StateKind(body["state_kind"])
            for part in ("kv_tensors", "state_tensors"):
                body[part] = tuple(TensorSpec.from_wire(s) for s in body[part])
            body["conv_shard_groups"] = tuple(tuple(tuple(p) for p in g) for g in body["conv_shard_groups"])
            for name in ("layer_ids", "state_layer_ids", "state_dims"):
                body[name] = tuple(body[name])
            return cls(**body)
        except LayoutMismatch:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LayoutMismatch(f"layout message has the wrong shape: {type(exc).__name__}: {exc}") from None


def _described(name: str, pool):
    describe = getattr(pool, "transfer_layout", None)
    if not callable(describe):
        raise TypeError(f"{name} must describe its buffers with transfer_layout() (see pools.describe), "
                        f"got {type(pool).__name__}")
    return describe()


def _from_pools(kv_pool, state_pool, tp_rank, tp_size, total_kv_heads, conv_shard_groups) -> RankLayout:
    described = _described("kv_pool", kv_pool)
    kv = described.kv
    if kv is None:
        raise TypeError(f"kv_pool must hold KV buffers; {type(kv_pool).__name__}.transfer_layout() describes none")
    holder, state = kv_pool, described.state
    if state_pool is not None:
        holder, state = state_pool, _described("state_pool", state_pool).state
        if state is None:
            raise TypeError(f"state_pool must hold state buffers; {type(state_pool).__name__}.transfer_layout() "
                            f"describes none")
    kv_specs, _ = _specs_of(kv, tp_size, total_kv_heads, None)
    total_heads = next((s.groups[0][0] for s in kv_specs if s.shard is ShardRule.HEADS), 1)
    layout = RankLayout(kv.kind, tp_rank, tp_size, kv.page_size, kv.layer_ids, kv.dtype, kv.head_dim,
                        kv.v_head_dim, total_heads, kv.num_slots, kv_specs)
    _check_export(kv_pool, kv, kv_specs)
    if state is not None:
        state_specs, conv = _specs_of(state, tp_size, None, conv_shard_groups)
        layout = _replace(layout, state_kind=state.kind, state_layer_ids=state.layer_ids,
                          state_page_size=state.page_size, state_num_slots=state.num_slots, state_tensors=state_specs,
                          state_dims=state.dims, conv_shard_groups=conv)
        _check_export(holder, state, state_specs)
    return layout


def _specs_of(part, tp_size: int, total_heads: Optional[int], conv_shard_groups):
    """``(specs, model_groups)``: a described part's TensorSpecs (this rank's rows cut from the
    unsharded ones) and the sub-blocks of its tensors that the model cuts (Mamba conv)."""
    model_cut = [t.units for t in part.tensors if t.model_sub_blocks]
    model_groups = _conv_groups(conv_shard_groups, model_cut, tp_size) if model_cut else ()
    specs, conv = [], iter(enumerate(model_groups))
    for t in part.tensors:
        shard = t.shard
        if t.model_sub_blocks:
            i, groups = next(conv)
        elif shard is ShardRule.REPLICATED:
            groups = ((1, 1),)
        elif shard is ShardRule.HEADS:
            groups = ((total_heads if total_heads is not None else t.units * tp_size, 1),)
        else:  # one block, split evenly
            groups = ((t.units * tp_size, 1),)
        spec = _spec(t.name, t.export_index, shard, t.unit_bytes, groups, tp_size, part.page_size,
                     (t.section_start, t.page_bytes))
        if spec.row_bytes != t.row_bytes:
            held = spec.row_bytes // t.unit_bytes
            if shard is ShardRule.HEADS:
                raise LayoutMismatch(f"pool holds {t.units} heads, but {groups[0][0]} total KV heads at TP {tp_size} "
                                     f"give {held} per rank (pass total_kv_heads)")
            if t.model_sub_blocks:
                raise ValueError(_conv_mismatch(i, groups, held, tp_size, t.units))  # the caller's groups
            raise LayoutMismatch(f"{t.name}: TP {tp_size} gives {held} units per rank, the pool holds {t.units}")
        specs.append(spec)
    return tuple(specs), model_groups


def _check_export(pool, part, specs) -> None:
    """The pool's export (``part.export``) must list one buffer per tensor kind and layer, each
    ``item_len`` the page bytes of the description and each ``data_len`` its pages."""
    export = part.export.value
    _, lens, items = getattr(pool, export)()
    num_layers = len(part.layer_ids)
    want = len({s.export_index for s in specs}) * num_layers
    if len(items) != want or len(lens) != want:
        raise LayoutMismatch(f"{export} must list {want} buffers ({len(specs)} tensor kinds x {num_layers} layers), "
                             f"got {len(items)} item lengths and {len(lens)} data lengths")
    pages, rows = divmod(part.num_slots, part.page_size)  # whole pages, then rows of a last partial one
    for spec in specs:
        size = pages * spec.page_bytes + rows * spec.row_bytes
        for j in range(num_layers):
            b = spec.export_index * num_layers + j
            if items[b] != spec.page_bytes:
                raise LayoutMismatch(f"{export} item_len of buffer {b} ({spec.name}, layer position {j}) is "
                                     f"{items[b]}, the pool's description gives {spec.page_bytes}")
            if lens[b] != size:
                raise LayoutMismatch(f"{export} data_len of buffer {b} ({spec.name}, layer position {j}) is "
                                     f"{lens[b]}, the pool's description gives {size} ({part.num_slots} slots)")


def _conv_groups(conv_shard_groups, conv_dims, tp_size: int) -> tuple:
    """Per conv tensor its unsharded sub-blocks (see :meth:`RankLayout.with_mamba`)."""
    if conv_shard_groups is None:
        per_tensor = [[d * tp_size] for d in conv_dims]
    elif any(isinstance(g, list) for g in conv_shard_groups):
        per_tensor = list(conv_shard_groups)
    else:
        per_tensor = [list(conv_shard_groups)] * len(conv_dims)
    if len(per_tensor) != len(conv_dims):
        raise ValueError(f"conv_shard_groups needs one entry per conv tensor ({len(conv_dims)}), got {len(per_tensor)}")
    return tuple(tuple(_sub_block(e) for e in g) for g in per_tensor)


def _conv_mismatch(i: int, groups, held: int, tp_size: int, conv_dim: int) -> str:
    return (f"conv tensor {i}: conv_shard_groups {_show(groups)} (units, size) give {held} channels per rank at "
            f"TP {tp_size}, the pool's conv_dim is {conv_dim}")


def _sub_block(entry) -> tuple:
    """A conv_shard_groups entry: ``c`` -> ``(c, 1)``; ``(units, size)`` as is."""
    if isinstance(entry, int) and not isinstance(entry, bool) and entry > 0:
        return (entry, 1)
    if (isinstance(entry, tuple) and len(entry) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in entry)):
        return entry
    raise ValueError(f"a conv_shard_groups entry must be a positive int or a (units, size) tuple, got {entry!r}")


def _replace(layout: RankLayout, **changes) -> RankLayout:
    from dataclasses import replace

    return replace(layout, **changes)


def _show(v) -> str:
    """A field value for an error message: enums by value, tuples as lists (long ones cut)."""
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple):
        items = [_show(x) if isinstance(x, tuple) else repr(x) for x in v]
        if len(items) > 12:
            items = items[:5] + [f"... ({len(v)} items) ..."] + items[-5:]
        return "[" + ", ".join(items) + "]"
    return repr(v)
