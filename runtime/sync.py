"""Weight sync: trainer rank 0 -> every rollout worker, packed buckets over a torch.distributed side group.

One sync = one stream (DESIGN §5): the policy AND the drafter, all tensors of both, go out as a fixed sequence
of broadcasts from the sender (trainer rank 0). Never one RPC per parameter.

Wire protocol of one sync (all broadcasts from rank 0, then one all-reduce):

1. header   int64[8]  magic, protocol, weight version, metadata length, total bytes, bucket bytes, buckets, 0
2. metadata uint8[n]  JSON: names, dtypes, shapes, byte offsets (64-byte aligned) of every tensor, in order
3. buckets  uint8[b]  the flat byte space [0, total) cut into windows of at most `bucket_bytes` (listed in the
                      metadata; a few small ones first); one broadcast each, received in place
4. trailer  int64[4]  magic, COMMIT or ABORT, weight version, buckets sent
5. ack      int64[1]  all-reduce(SUM) of 1 from every member: the sender returns only when all have the bytes

Throughput: the receiver broadcasts straight into slices of one flat buffer (no receive-side copy; the
tensors it returns are views into that buffer) and reuses a small pool of such buffers, so pages are not faulted
in again on every sync. On the sender, a trainer that called `flatten_modules_` once keeps its parameters as
views of one buffer in sync layout: every bucket then leaves straight from parameter memory (zero copies;
detected automatically). Otherwise a window inside one contiguous tensor is still sent from that tensor's
memory, and only windows that straddle tensors are packed, into one of two staging buffers, while the previous
window is on the wire (double buffering with async work handles; the first windows are small so the pipeline
starts early). On loopback the packing copy costs as much CPU as the kernel's own copy, hence the flattening.

Atomicity: `WeightReceiver.receive()` returns a *new* state (fresh views, a buffer the live state does not use)
only after the COMMIT trailer arrived; anything else (ABORT trailer, a sender that died, a timeout, a header
that does not parse) raises `SyncAborted` and the caller keeps its previous weights; its `group_usable` says
whether the next sync can reuse the group (clean ABORT) or the group must be rebuilt first (broken stream). `VersionedWeights.swap`
installs (version, state) in one assignment under a lock, so a reader never sees a mix of two versions.

Groups: `SyncGroup` is a *stateless* process group (TCPStore + PrefixStore + ProcessGroupGloo/NCCL built
directly); it never touches torch.distributed's default group, so the trainers' data-parallel group and this
side group coexist in one process. The sender (rank 0) hosts the TCPStore. Groups cannot be resized: on a
membership change every member calls `rebuild(members, epoch)` with the new member list and a new epoch
(a fresh key prefix), concurrently, as construction is itself a rendezvous.

Call sequence for the RL runtime (Ray actors; the coordinator drives every step)::

    # every member, concurrently (construction blocks until all `len(members)` have joined):
    members = [f"{job}-trainer-0", f"{job}-rollout-0", f"{job}-rollout-1"]     # rank = position; [0] sends
    group = SyncGroup.join(members, me, epoch=0, backend=job.spec.weight_sync.backend)
    #                                                      host/port: args or SPECRL_SYNC_MASTER_ADDR/_PORT
    # trainer rank 0, once at start-up (parameters become views of one buffer; tied weights stay tied;
    # the optimizer keeps working since the Parameter objects are the same):
    flatten_modules_(policy=model, drafter=drafter)
    sender = WeightSender(group, bucket_mib=job.spec.weight_sync.bucket_mib, metrics=runtime_metrics)
    stats = sender.send(merge_states(policy=model.state_dict(), drafter=drafter.state_dict()), version=v)
    # each rollout worker, at the same time as the send (coordinator: ray.get([trainer.send, *receivers]))
    receiver = WeightReceiver(group, metrics=runtime_metrics)
    version, flat, stats = receiver.receive()             # raises SyncAborted -> keep the old weights
    parts = split_states(flat)                            # {"policy": {...}, "drafter": {...}}
    weights.swap(version, parts)                          # VersionedWeights; the engine loads it between steps
    # membership change at a step boundary: everyone in the NEW member list, concurrently
    group.rebuild(new_members, epoch=group.epoch + 1)     # new joiners: SyncGroup.join(new_members, me, epoch)
    # a drained worker calls group.close() and leaves.

In async mode a rollout worker runs `receive()` in a background thread while it keeps generating on the old
weights and swaps at its next safe point (between engine steps); in sync mode the swap happens before the
next step's rollouts start. With the default `pool=2` the views of receive n stay valid until receive n+2
starts (n+1 then holds the other buffer): copy them (`load_state_dict` copies), or raise `pool` when more
states must stay alive at once.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import (
    AllreduceOptions,
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    ReduceOp,
    Store,
    TCPStore,
)

if TYPE_CHECKING:
    from .metrics import RuntimeMetrics

MAGIC = 0x5350_4543_524C  # "SPECRL"
PROTOCOL = 1
COMMIT = 1
ABORT = 2
ALIGN = 64  # byte alignment of every tensor in the flat space (any dtype view is then aligned)
DEFAULT_BUCKET_MIB = 64
DEFAULT_TIMEOUT_S = 300.0
MAX_METADATA_BYTES = 256 << 20  # a header asking for more is not from a specrl sender

# dtypes that may travel (a whitelist: the metadata is parsed on the receiver, never eval'd).
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
              torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
}


class SyncError(RuntimeError):
    """A weight sync could not run (bad input, group broken); names what went wrong."""


class SyncAborted(SyncError):
    """The transfer did not complete; the receiver's previous weights are untouched.

    `group_usable` tells whether the stream stayed aligned (the sender aborted cleanly: the next sync can
    use the same group) or not (a peer died, a timeout, garbage on the wire: rebuild the group first).
    """

    def __init__(self, message: str, group_usable: bool = False) -> None:
        super().__init__(message)
        self.group_usable = group_usable


# ----------------------------------------------------------------------------------------------- layout (pure)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # byte offset in the flat space; an alias (tied weight) repeats an earlier entry's offset
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Where every tensor lives in the flat byte space, and the windows (buckets) that space is sent in."""

    tensors: tuple[TensorMeta, ...]
    total_bytes: int
    bucket_bytes: int
    windows: tuple[tuple[int, int], ...]

    @property
    def num_buckets(self) -> int:
        return len(self.windows)

    def bucket(self, k: int) -> tuple[int, int]:
        return self.windows[k]

    def to_json(self) -> bytes:
        return json.dumps({"tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors],
                           "total_bytes": self.total_bytes, "bucket_bytes": self.bucket_bytes,
                           "windows": [list(w) for w in self.windows]}, separators=(",", ":")).encode()

    @staticmethod
    def from_json(raw: bytes) -> Layout:
        try:
            doc = json.loads(raw)
            tensors = tuple(TensorMeta(str(n), str(d), tuple(int(x) for x in s), int(o), int(b))
                            for n, d, s, o, b in doc["tensors"])
            windows = tuple((int(lo), int(hi)) for lo, hi in doc["windows"])
            layout = Layout(tensors, int(doc["total_bytes"]), int(doc["bucket_bytes"]), windows)
        except (ValueError, KeyError, TypeError) as exc:
            raise SyncAborted(f"weight sync metadata does not parse: {exc}") from None
        layout.validate()
        return layout

    def validate(self) -> None:
        """Reject metadata that would make the receiver read or write outside its buffer."""
        end = 0
        placed: set[tuple[int, int, str]] = set()
        for t in self.tensors:
            if t.dtype not in DTYPES:
                raise SyncAborted(f"weight sync metadata: tensor {t.name!r} has unsupported dtype {t.dtype!r}")
            numel = 1
            for d in t.shape:
                if d < 0:
                    raise SyncAborted(f"weight sync metadata: tensor {t.name!r} has a negative dimension")
                numel *= d
            if t.nbytes != numel * DTYPES[t.dtype].itemsize or t.offset % ALIGN:
                raise SyncAborted(f"weight sync metadata: tensor {t.name!r} has an inconsistent layout")
            if (t.offset, t.nbytes, t.dtype) in placed:
                continue  # alias of an earlier tensor
            if t.offset < end:
                raise SyncAborted(f"weight sync metadata: tensor {t.name!r} overlaps the previous tensor")
            placed.add((t.offset, t.nbytes, t.dtype))
            end = t.offset + t.nbytes
        if end > self.total_bytes or self.bucket_bytes <= 0:
            raise SyncAborted("weight sync metadata: sizes are inconsistent")
        pos = 0
        for lo, hi in self.windows:
            if lo != pos or not 0 < hi - lo <= self.bucket_bytes:
                raise SyncAborted("weight sync metadata: buckets do not tile the byte space")
            pos = hi
        if pos != self.total_bytes:
            raise SyncAborted("weight sync metadata: buckets do not cover the byte space")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_windows(total_bytes: int, bucket_bytes: int) -> tuple[tuple[int, int], ...]:
    """Cut [0, total) into buckets of `bucket_bytes`, the first few smaller (1/16, 1/8, ... of a bucket).

    The ramp lets the pipeline start early: the first broadcast leaves after packing 1/16 of a bucket instead
    of a whole one. It adds at most four broadcasts per sync.
    """
    windows: list[tuple[int, int]] = []
    size = min(bucket_bytes, max(ALIGN, bucket_bytes // 16, min(bucket_bytes, 1 << 20)))
    lo = 0
    while lo < total_bytes:
        hi = min(lo + size, total_bytes)
        windows.append((lo, hi))
        lo = hi
        size = min(bucket_bytes, size * 2)
    return tuple(windows)


def _identity(t: torch.Tensor) -> tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], str]:
    return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), str(t.device))


def plan_layout(named: Mapping[str, torch.Tensor], bucket_bytes: int) -> Layout:
    """Deterministic layout: tensors in the mapping's order, each at a 64-byte-aligned offset.

    A name whose tensor is the very same memory as an earlier one (tied embeddings) becomes an alias: it is
    sent once and the receiver returns two names viewing the same bytes, as the sender's module has them.
    """
    if bucket_bytes < ALIGN:
        raise SyncError(f"bucket size must be at least {ALIGN} bytes, got {bucket_bytes}")
    metas: list[TensorMeta] = []
    seen: dict[tuple[Any, ...], TensorMeta] = {}
    offset = 0
    for name, t in named.items():
        if not isinstance(name, str) or not name:
            raise SyncError(f"weight sync: tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise SyncError(f"weight sync: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        key = str(t.dtype).removeprefix("torch.")
        if key not in DTYPES:
            raise SyncError(f"weight sync: tensor {name!r} has unsupported dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        ident = _identity(t)
        if nbytes and ident in seen:
            first = seen[ident]
            metas.append(TensorMeta(name, key, tuple(t.shape), first.offset, first.nbytes))
            continue
        offset = _align(offset)
        meta = TensorMeta(name, key, tuple(t.shape), offset, nbytes)
        metas.append(meta)
        if nbytes:
            seen[ident] = meta
        offset += nbytes
    return Layout(tuple(metas), offset, bucket_bytes, plan_windows(offset, bucket_bytes))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor as a flat uint8 tensor sharing its memory (copies only if non-contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _primary(layout: Layout, sources: Sequence[torch.Tensor]) -> tuple[list[TensorMeta], list[torch.Tensor]]:
    """Layout entries that own their bytes (aliases dropped), with their byte views, in offset order."""
    metas: list[TensorMeta] = []
    srcs: list[torch.Tensor] = []
    end = -1
    for meta, src in zip(layout.tensors, sources):
        if meta.nbytes and meta.offset >= end:
            metas.append(meta)
            srcs.append(src)
            end = meta.offset + meta.nbytes
    return metas, srcs


def pack_bucket(layout: Layout, sources: Sequence[torch.Tensor], k: int, out: torch.Tensor) -> torch.Tensor:
    """Copy the bytes of bucket `k` into `out` (uint8, >= bucket size); returns the filled slice of `out`.

    `sources` are the byte views of the tensors in layout order. Alignment padding is left as is (ignored).
    """
    metas, srcs = _primary(layout, sources)
    return _pack(metas, srcs, *layout.bucket(k), out)


def direct_slice(layout: Layout, sources: Sequence[torch.Tensor], k: int) -> torch.Tensor | None:
    """Bucket `k` as a view of one tensor's own memory when it lies entirely inside that tensor, else None."""
    metas, srcs = _primary(layout, sources)
    return _direct(metas, srcs, *layout.bucket(k))


def _pack(metas: Sequence[TensorMeta], srcs: Sequence[torch.Tensor], lo: int, hi: int,
          out: torch.Tensor) -> torch.Tensor:
    for meta, src in _overlapping(metas, srcs, lo, hi):
        a, b = max(lo, meta.offset), min(hi, meta.offset + meta.nbytes)
        out[a - lo:b - lo].copy_(src[a - meta.offset:b - meta.offset])
    return out[:hi - lo]


def _direct(metas: Sequence[TensorMeta], srcs: Sequence[torch.Tensor], lo: int, hi: int) -> torch.Tensor | None:
    hits = list(_overlapping(metas, srcs, lo, hi))
    if len(hits) == 1:
        meta, src = hits[0]
        if meta.offset <= lo and hi <= meta.offset + meta.nbytes:
            return src[lo - meta.offset:hi - meta.offset]
    return None


def flat_source(layout: Layout, sources: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The whole byte space as one uint8 view when the tensors already sit in one buffer at the layout's offsets.

    That is the case for modules flattened with `flatten_modules_`; every bucket is then sent straight from
    the parameters' memory, with no packing copy at all.
    """
    metas, srcs = _primary(layout, sources)
    if not metas:
        return None
    storage = srcs[0].untyped_storage()
    base = srcs[0].data_ptr() - metas[0].offset
    start = base - storage.data_ptr()
    if start < 0 or start + layout.total_bytes > storage.nbytes():
        return None
    for meta, src in zip(metas, srcs):
        if src.untyped_storage().data_ptr() != storage.data_ptr() or src.data_ptr() - base != meta.offset:
            return None
    return torch.empty(0, dtype=torch.uint8, device=srcs[0].device).set_(storage, start, (layout.total_bytes,), (1,))


def _overlapping(metas: Sequence[TensorMeta], sources: Sequence[torch.Tensor], lo: int, hi: int
                 ) -> Iterator[tuple[TensorMeta, torch.Tensor]]:
    # Entries are sorted by offset; a binary search keeps this O(log n + hits) per bucket.
    left, right = 0, len(metas)
    while left < right:
        mid = (left + right) // 2
        if metas[mid].offset + metas[mid].nbytes <= lo:
            left = mid + 1
        else:
            right = mid
    for i in range(left, len(metas)):
        if metas[i].offset >= hi:
            break
        yield metas[i], sources[i]


def unpack(layout: Layout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views into `flat` (uint8, total_bytes long) shaped and typed as the layout says; no copies."""
    out: dict[str, torch.Tensor] = {}
    for meta in layout.tensors:
        raw = flat[meta.offset:meta.offset + meta.nbytes]
        dtype = DTYPES[meta.dtype]
        out[meta.name] = (raw if dtype == torch.uint8 else raw.view(dtype)).view(meta.shape)
    return out


def flatten_state(named: Mapping[str, torch.Tensor], device: torch.device | str | None = None
                  ) -> dict[str, torch.Tensor]:
    """Copies of `named` that are views into one buffer laid out exactly as a sync sends it (zero-copy sends)."""
    layout = plan_layout({k: t.detach() for k, t in named.items()}, DEFAULT_BUCKET_MIB << 20)
    first = next(iter(named.values()), None)
    dev = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
    flat = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=dev)
    views = unpack(layout, flat)
    for name, t in named.items():
        views[name].copy_(t.detach())
    return views


def flatten_modules_(**modules: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Move the parameters and persistent buffers of `modules` into one buffer, in place.

    `flatten_modules_(policy=model, drafter=head)` on the trainer, once, before the optimizer is created: the
    modules keep working (parameters become views of the buffer, tied weights stay tied) and every later
    `WeightSender.send(merge_states(policy=model.state_dict(), drafter=head.state_dict()), v)` goes out
    straight from the parameters' memory with no packing copy. Returns the merged name -> view mapping.
    """
    named = merge_states(**{part: m.state_dict(keep_vars=True) for part, m in modules.items()})
    views = flatten_state(named)
    for part, module in modules.items():
        for name, p in module.named_parameters(remove_duplicate=False):
            key = f"{part}/{name}"
            if key in views:
                p.data = views[key]
        for name, b in module.named_buffers(remove_duplicate=False):
            key = f"{part}/{name}"
            if key in views and b is not None:
                b.data = views[key]
    return views


def merge_states(**states: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One flat stream from several state dicts: `merge_states(policy=sd, drafter=sd2)` -> {"policy/x": ...}."""
    merged: dict[str, torch.Tensor] = {}
    for part, sd in states.items():
        if "/" in part:
            raise SyncError(f"weight sync: part name {part!r} must not contain '/'")
        for name, t in sd.items():
            merged[f"{part}/{name}"] = t
    return merged


def split_states(flat: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Inverse of `merge_states`."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        part, sep, name = key.partition("/")
        if not sep:
            raise SyncError(f"weight sync: tensor {key!r} has no '<part>/' prefix (use merge_states)")
        parts.setdefault(part, {})[name] = t
    return parts


# ----------------------------------------------------------------------------------------------------- group


def _local_address_towards(host: str, port: int) -> str:
    """The local IP that routes to host:port (the address peers can reach our gloo device on)."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))  # UDP connect sends nothing; it only picks the route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


def rendezvous_from_env(host: str | None = None, port: int | None = None) -> tuple[str, int]:
    host = host or os.environ.get("SPECRL_SYNC_MASTER_ADDR")
    raw_port = port if port is not None else os.environ.get("SPECRL_SYNC_MASTER_PORT")
    if not host or raw_port is None or raw_port == "":
        raise SyncError("weight sync rendezvous unknown: pass host/port or set SPECRL_SYNC_MASTER_ADDR and "
                        "SPECRL_SYNC_MASTER_PORT")
    try:
        return host, int(raw_port)
    except ValueError:
        raise SyncError(f"SPECRL_SYNC_MASTER_PORT must be an integer, got {raw_port!r}") from None


class SyncGroup:
    """A stateless torch.distributed group for weight sync. Rank 0 sends and hosts the TCPStore."""

    def __init__(self, store: Store, rank: int, world_size: int, backend: str, epoch: int,
                 timeout: datetime.timedelta, device_host: str, members: Sequence[str] | None = None) -> None:
        self.store = store
        self.backend = backend
        self.timeout = timeout
        self.device_host = device_host
        self.rank = rank
        self.world_size = world_size
        self.epoch = epoch
        self.members: tuple[str, ...] = tuple(members) if members else ()
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.pg: Any = self._build(rank, world_size, epoch)

    # -- construction
    @classmethod
    def create(cls, host: str | None = None, port: int | None = None, *, rank: int, world_size: int,
               backend: str = "gloo", epoch: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S,
               members: Sequence[str] | None = None) -> SyncGroup:
        """Join (or, as rank 0, host) the group. Blocks until all `world_size` members have joined."""
        host, port = rendezvous_from_env(host, port)
        if backend not in ("gloo", "nccl"):
            raise SyncError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise SyncError(f"weight sync: rank {rank} is not in a group of {world_size}")
        if backend == "nccl" and (getattr(torch.distributed, "ProcessGroupNCCL", None) is None
                                  or not torch.cuda.is_available()):
            raise SyncError("weight sync backend 'nccl' needs a GPU and a CUDA build of torch; use 'gloo' on CPU")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = TCPStore(host, port, None, rank == 0, timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise SyncError(f"weight sync: cannot reach the rendezvous store at {host}:{port}: {exc}") from None
        return cls(store, rank, world_size, backend, epoch, timeout, _local_address_towards(host, port), members)

    @classmethod
    def join(cls, members: Sequence[str], me: str, epoch: int = 0, host: str | None = None,
             port: int | None = None, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> SyncGroup:
        """Join by name: rank = position of `me` in `members` (members[0] is the sender)."""
        rank = cls._rank_of(members, me)
        return cls.create(host, port, rank=rank, world_size=len(members), backend=backend, epoch=epoch,
                          timeout_s=timeout_s, members=members)

    @staticmethod
    def _rank_of(members: Sequence[str], me: str) -> int:
        if len(set(members)) != len(members):
            raise SyncError(f"weight sync: duplicate names in members {list(members)}")
        if me not in members:
            raise SyncError(f"weight sync: {me!r} is not among the members {list(members)}")
        return list(members).index(me)

    def _build(self, rank: int, world_size: int, epoch: int) -> Any:
        prefix = PrefixStore(f"specrl-sync/epoch-{epoch}/", self.store)
        try:
            if self.backend == "nccl":
                nccl = torch.distributed.ProcessGroupNCCL  # availability checked in create()
                opts = nccl.Options()
                opts._timeout = self.timeout
                return nccl(prefix, rank, world_size, opts)
            # torch's stub calls it Options, which at runtime is Backend.Options; gloo's own class is _Options
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # see above
            opts._timeout = self.timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname=self.device_host)]
            return ProcessGroupGloo(prefix, rank, world_size, opts)
        except RuntimeError as exc:
            raise SyncError(f"weight sync: group epoch {epoch} (rank {rank} of {world_size}) could not form: "
                            f"{exc}") from None

    def rebuild(self, members: Sequence[str] | int, epoch: int, me: str | None = None) -> None:
        """New membership: a new group under a new epoch prefix. Every new member calls this concurrently.

        `members` is the new list of names (this member's rank is its position; `me` defaults to our current
        name) or just the new world size, keeping our rank.
        """
        if epoch <= self.epoch:
            raise SyncError(f"weight sync: rebuild needs a new epoch > {self.epoch}, got {epoch}")
        names: tuple[str, ...]
        if isinstance(members, int):
            world_size, rank, names = members, self.rank, ()
        else:
            me = me or (self.members[self.rank] if self.members else None)
            if me is None:
                raise SyncError("weight sync: rebuild(members) needs `me` when the group was created by rank")
            rank, world_size, names = self._rank_of(members, me), len(members), tuple(members)
        if (self.rank == 0) != (rank == 0):
            raise SyncError("weight sync: the sender hosts the rendezvous store and must stay rank 0 "
                            "(a new sender needs a new group: SyncGroup.create)")
        if self.store is None:
            raise SyncError("weight sync: this group was closed; join again with SyncGroup.create/join")
        if not 0 <= rank < world_size:
            raise SyncError(f"weight sync: rank {rank} is not in a group of {world_size}")
        self.close_group()
        self.pg = self._build(rank, world_size, epoch)
        self.rank, self.world_size, self.epoch, self.members = rank, world_size, epoch, names

    @property
    def closed(self) -> bool:
        return self.pg is None

    def close_group(self) -> None:
        """Leave the current process group (the store stays; `rebuild` forms the next one).

        Dropping the group closes its connections, so peers blocked in a collective with us fail at once
        instead of waiting for their timeout; a coordinator uses this to unblock a stuck sync.
        """
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:
                pass
            del pg

    def close(self) -> None:
        self.close_group()
        self.store = None  # type: ignore[assignment]  # the host's store server stops with its last reference

    # -- collectives used by the protocol
    def broadcast(self, t: torch.Tensor) -> Any:
        if self.pg is None:
            raise SyncError("weight sync group is closed; rebuild() it first")
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self.timeout
        return self.pg.broadcast([t], opts)

    def allreduce_sum(self, t: torch.Tensor) -> Any:
        if self.pg is None:
            raise SyncError("weight sync group is closed; rebuild() it first")
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp(ReduceOp.SUM)
        opts.timeout = self.timeout
        return self.pg.allreduce([t], opts)


# ------------------------------------------------------------------------------------------- sender / receiver


@dataclass(frozen=True)
class SyncStats:
    bytes: int
    seconds: float
    buckets: int
    version: int
    bucket_bytes: int
    direct_buckets: int = 0  # buckets sent straight from tensor memory (no packing copy)

    @property
    def gbps(self) -> float:
        """GB/s (10^9 bytes per second) of weight bytes moved."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _header(version: int, meta_len: int, layout: Layout) -> torch.Tensor:
    return torch.tensor([MAGIC, PROTOCOL, version, meta_len, layout.total_bytes, layout.bucket_bytes,
                         layout.num_buckets, 0], dtype=torch.int64)


class WeightSender:
    """Trainer rank 0's side of a weight sync."""

    def __init__(self, group: SyncGroup, bucket_mib: float = DEFAULT_BUCKET_MIB, inflight: int = 2,
                 metrics: RuntimeMetrics | None = None) -> None:
        if group.rank != 0:
            raise SyncError(f"WeightSender must run on rank 0 of the sync group, not rank {group.rank}")
        if not bucket_mib > 0:
            raise SyncError(f"bucketMiB must be positive, got {bucket_mib}")
        if inflight < 1:
            raise SyncError(f"inflight must be >= 1, got {inflight}")
        self.group = group
        self.bucket_bytes = max(ALIGN, int(bucket_mib * (1 << 20)) // ALIGN * ALIGN)
        self.inflight = inflight
        self.metrics = metrics
        self._staging: list[torch.Tensor] = []
        self._direct = 0

    def _staging_buffer(self, i: int) -> torch.Tensor:
        while len(self._staging) <= i:
            self._staging.append(torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.group.device))
        return self._staging[i]

    def send(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        """Broadcast every tensor to all members; returns after every member acknowledged the bytes."""
        if not isinstance(version, int) or version < 0:
            raise SyncError(f"weight version must be a non-negative int, got {version!r}")
        t0 = time.perf_counter()
        layout = plan_layout(named_tensors, self.bucket_bytes)  # validates before anything goes on the wire
        dev = self.group.device
        sources = [byte_view(t if t.device == dev else t.to(dev)) for t in named_tensors.values()]
        meta_raw = layout.to_json()
        try:
            self._send_stream(layout, sources, meta_raw, version)
        except SyncAborted as exc:
            self._count_failure()
            if not exc.group_usable:
                self.group.close_group()
            raise
        except SyncError:
            self._count_failure()
            raise
        except RuntimeError as exc:  # gloo/NCCL: a peer vanished or timed out
            self._count_failure()
            # Closing our end makes the surviving receivers fail now instead of at their timeout.
            self.group.close_group()
            raise SyncAborted(f"weight sync v{version} failed on the sender: {exc}") from None
        seconds = time.perf_counter() - t0
        stats = SyncStats(layout.total_bytes, seconds, layout.num_buckets, version, self.bucket_bytes,
                          self._direct)
        if self.metrics is not None:
            self.metrics.sync_bytes.inc(stats.bytes)
            self.metrics.sync_duration.observe(seconds)
            self.metrics.weight_version.set(version)
        return stats

    def _count_failure(self) -> None:
        if self.metrics is not None:
            self.metrics.sync_failures.inc()

    def _send_stream(self, layout: Layout, sources: list[torch.Tensor], meta_raw: bytes, version: int) -> None:
        g = self.group
        dev = g.device
        g.broadcast(_header(version, len(meta_raw), layout).to(dev)).wait()
        g.broadcast(torch.frombuffer(bytearray(meta_raw), dtype=torch.uint8).to(dev)).wait()
        # Buckets: up to `inflight` broadcasts outstanding; staging buffer i is reused only after its work is done.
        pending: list[tuple[Any, int | None]] = []  # (work, staging slot or None for direct sends)
        free_slots = list(range(self.inflight))
        self._direct = 0
        flat = flat_source(layout, sources)  # parameters already in one buffer: send it as is
        metas, srcs = _primary(layout, sources)
        status, sent, error = COMMIT, 0, None
        for k in range(layout.num_buckets):
            while len(pending) >= self.inflight:
                work, done_slot = pending.pop(0)
                work.wait()
                if done_slot is not None:
                    free_slots.append(done_slot)
            lo, hi = layout.bucket(k)
            chunk: torch.Tensor | None = None
            slot: int | None = None
            if error is None:
                try:
                    chunk = flat[lo:hi] if flat is not None else _direct(metas, srcs, lo, hi)
                    if chunk is not None:
                        self._direct += 1
                    else:
                        slot = free_slots.pop(0)
                        chunk = _pack(metas, srcs, lo, hi, self._staging_buffer(slot))
                except (RuntimeError, ValueError) as exc:
                    # Packing failed (not the wire): keep the stream aligned with filler, then ABORT the version,
                    # so the receivers stay in step and keep their weights.
                    error, status = exc, ABORT
            if error is not None:
                if slot is None:
                    slot = free_slots.pop(0)
                chunk = self._staging_buffer(slot)[:hi - lo]
            assert chunk is not None  # packed, sent in place, or filler after an error
            pending.append((g.broadcast(chunk), slot))
            sent += 1
        for work, _ in pending:
            work.wait()
        trailer = torch.tensor([MAGIC, status, version, sent], dtype=torch.int64)
        g.broadcast(trailer.to(dev)).wait()
        ack = torch.ones(1, dtype=torch.int64, device=dev)
        g.allreduce_sum(ack).wait()
        if status == ABORT:
            raise SyncAborted(f"weight sync v{version} aborted while packing: {error}", group_usable=True)
        if int(ack.item()) != g.world_size:
            raise SyncAborted(f"weight sync v{version}: {g.world_size - int(ack.item())} receiver(s) did not "
                              "acknowledge")


class WeightReceiver:
    """A rollout worker's side of a weight sync."""

    def __init__(self, group: SyncGroup, inflight: int = 4, pool: int = 2,
                 metrics: RuntimeMetrics | None = None) -> None:
        if group.rank == 0:
            raise SyncError("WeightReceiver cannot run on rank 0 (the sender) of the sync group")
        if pool < 2:
            raise SyncError(f"pool must be >= 2 so a receive never overwrites the live state, got {pool}")
        self.group = group
        self.inflight = max(1, inflight)
        self.pool = pool
        self.metrics = metrics
        self._buffers: list[torch.Tensor] = []
        self._live: int | None = None  # index of the buffer that backs the last state handed out
        self.version: int | None = None

    def _buffer(self, nbytes: int) -> tuple[int, torch.Tensor]:
        # Reuse a buffer that does not back the live state; first-touching fresh pages costs more than the wire.
        candidates = [i for i in range(len(self._buffers)) if i != self._live]
        for i in candidates:
            if self._buffers[i].numel() >= nbytes:
                return i, self._buffers[i]
        new = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        if len(self._buffers) < self.pool:
            self._buffers.append(new)
            return len(self._buffers) - 1, new
        i = candidates[0]
        self._buffers[i] = new
        return i, new

    def receive(self) -> tuple[int, dict[str, torch.Tensor], SyncStats]:
        """Receive one sync. Returns (version, {name: tensor view}, stats) or raises SyncAborted."""
        t0 = time.perf_counter()
        try:
            version, layout, slot, flat = self._receive_stream()
        except SyncAborted as exc:
            self._count_failure()
            if not exc.group_usable:
                self.group.close_group()  # the stream is out of step: only a rebuilt group can carry on
            raise
        except SyncError:
            self._count_failure()
            raise
        except RuntimeError as exc:  # gloo/NCCL: sender died, connection closed, timeout
            self._count_failure()
            self.group.close_group()
            raise SyncAborted(f"weight sync interrupted on rank {self.group.rank}: {exc}") from None
        state = unpack(layout, flat)
        self._live = slot
        self.version = version
        seconds = time.perf_counter() - t0
        stats = SyncStats(layout.total_bytes, seconds, layout.num_buckets, version, layout.bucket_bytes)
        if self.metrics is not None:
            self.metrics.sync_bytes.inc(stats.bytes)
            self.metrics.sync_duration.observe(seconds)
        return version, state, stats

    def _count_failure(self) -> None:
        if self.metrics is not None:
            self.metrics.sync_failures.inc()

    def _receive_stream(self) -> tuple[int, Layout, int, torch.Tensor]:
        g = self.group
        dev = g.device
        header = torch.zeros(8, dtype=torch.int64, device=dev)
        g.broadcast(header).wait()
        magic, proto, version, meta_len, total, bucket_bytes, n_buckets, _ = (int(x) for x in header.cpu())
        if magic != MAGIC or proto != PROTOCOL:
            raise SyncAborted(f"weight sync: unexpected header (magic {magic:#x}, protocol {proto}); "
                              "sender and receiver disagree on the protocol")
        if not 0 < meta_len <= MAX_METADATA_BYTES or total < 0 or n_buckets < 0:
            raise SyncAborted(f"weight sync v{version}: implausible header (metadata {meta_len} bytes)")
        meta = torch.empty(meta_len, dtype=torch.uint8, device=dev)
        g.broadcast(meta).wait()
        layout = Layout.from_json(meta.cpu().numpy().tobytes())
        if (layout.total_bytes, layout.bucket_bytes, layout.num_buckets) != (total, bucket_bytes, n_buckets):
            raise SyncAborted("weight sync: header and metadata disagree")
        slot, buf = self._buffer(max(total, 1))
        flat = buf[:total]
        pending: list[Any] = []
        for k in range(n_buckets):
            if len(pending) >= self.inflight:
                pending.pop(0).wait()
            lo, hi = layout.bucket(k)
            pending.append(g.broadcast(flat[lo:hi]))
        for work in pending:
            work.wait()
        trailer = torch.zeros(4, dtype=torch.int64, device=dev)
        g.broadcast(trailer).wait()
        t_magic, status, t_version, sent = (int(x) for x in trailer.cpu())
        ack = torch.ones(1, dtype=torch.int64, device=dev)
        g.allreduce_sum(ack).wait()
        if t_magic != MAGIC or t_version != version or sent != n_buckets:
            raise SyncAborted(f"weight sync v{version}: trailer does not match the header")
        if status != COMMIT:
            raise SyncAborted(f"weight sync v{version} was aborted by the sender", group_usable=True)
        return version, layout, slot, flat


# ---------------------------------------------------------------------------------------------- atomic swap


class VersionedWeights:
    """The state a worker serves, with its weight version; swapped in one assignment under a lock.

    `monotonic=True` rejects a version that is not newer than the installed one. It is off by default because
    a trainer resumed from a checkpoint legitimately sends a version older than what the rollouts hold.
    """

    def __init__(self, version: int = -1, state: Any = None, monotonic: bool = False) -> None:
        self._lock = threading.Lock()
        self._current: tuple[int, Any] = (version, state)
        self.monotonic = monotonic

    def swap(self, version: int, state: Any) -> None:
        with self._lock:
            if self.monotonic and version <= self._current[0]:
                raise SyncError(f"weight version must increase: have {self._current[0]}, got {version}")
            self._current = (version, state)

    def current(self) -> tuple[int, Any]:
        with self._lock:
            return self._current

    @property
    def version(self) -> int:
        return self.current()[0]


def receive_and_swap(receiver: WeightReceiver, weights: VersionedWeights,
                     on_swap: Callable[[int, dict[str, torch.Tensor]], None] | None = None) -> SyncStats:
    """Receive one sync and install it in `weights`; on any failure `weights` keeps the previous version."""
    version, state, stats = receiver.receive()
    if on_swap is not None:
        on_swap(version, state)
    weights.swap(version, state)
    if receiver.metrics is not None:
        receiver.metrics.weight_version.set(version)
    return stats


__all__ = [
    "ABORT",
    "COMMIT",
    "DEFAULT_BUCKET_MIB",
    "Layout",
    "SyncAborted",
    "SyncError",
    "SyncGroup",
    "SyncStats",
    "TensorMeta",
    "VersionedWeights",
    "WeightReceiver",
    "WeightSender",
    "byte_view",
    "direct_slice",
    "flat_source",
    "flatten_modules_",
    "flatten_state",
    "merge_states",
    "pack_bucket",
    "plan_layout",
    "plan_windows",
    "receive_and_swap",
    "rendezvous_from_env",
    "split_states",
    "unpack",
]
