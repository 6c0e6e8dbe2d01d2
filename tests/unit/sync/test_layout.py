"""Pure parts of the weight sync: layout, windows, packing/unpacking, flattening, atomic swap."""

from __future__ import annotations

import itertools
import json
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from specrl.runtime.sync import (
    ALIGN,
    Layout,
    SyncAborted,
    SyncError,
    VersionedWeights,
    byte_view,
    direct_slice,
    flat_source,
    flatten_modules_,
    flatten_state,
    merge_states,
    pack_bucket,
    plan_layout,
    plan_windows,
    split_states,
    unpack,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.int64, torch.uint8]


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


def wire(named: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[Layout, torch.Tensor, int]:
    """What the receiver's buffer holds after every bucket arrived (the sender's choice per bucket included)."""
    layout = plan_layout(named, bucket_bytes)
    sources = [byte_view(t) for t in named.values()]
    flat = torch.full((layout.total_bytes,), 0xAB, dtype=torch.uint8)
    staging = torch.empty(bucket_bytes, dtype=torch.uint8)
    direct = 0
    for k in range(layout.num_buckets):
        lo, hi = layout.bucket(k)
        chunk = direct_slice(layout, sources, k)
        if chunk is None:
            chunk = pack_bucket(layout, sources, k, staging)
        else:
            direct += 1
        assert chunk.numel() == hi - lo <= bucket_bytes
        flat[lo:hi].copy_(chunk)
    return Layout.from_json(layout.to_json()), flat, direct


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert torch.equal(got[k], w), k


@pytest.mark.parametrize("bucket_bytes", [64, 100 * ALIGN, 1 << 20])
def test_round_trip_all_dtypes_and_bucket_boundaries(bucket_bytes: int) -> None:
    named = {f"t{i}.{str(d)[6:]}": make(d, (37, 5 + i), i) for i, d in enumerate(DTYPES)}
    named["big"] = make(torch.float32, (300, 50), 99)  # 60 KB: spans many buckets
    named["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    named["empty"] = torch.zeros(0, 3)
    named["transposed"] = make(torch.float16, (20, 30), 7).t()  # non-contiguous source
    layout, flat, direct = wire(named, bucket_bytes)
    assert_same(unpack(layout, flat), named)
    assert all(t.offset % ALIGN == 0 for t in layout.tensors)
    if bucket_bytes == 64:
        assert direct > 0  # buckets inside the big tensor went out from its own memory


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), min_size=0, max_size=3)),
                min_size=1, max_size=12),
       st.integers(1, 64).map(lambda n: n * 64))
def test_round_trip_property(specs: list, bucket_bytes: int) -> None:
    named = {f"p{i}": make(d, tuple(shape), i) for i, (d, shape) in enumerate(specs)}
    layout, flat, _ = wire(named, bucket_bytes)
    assert_same(unpack(layout, flat), named)
    assert layout.windows[0][0] == 0 and layout.windows[-1][1] == layout.total_bytes if layout.total_bytes else True


def test_unpack_returns_views_not_copies() -> None:
    named = {"a": make(torch.float32, (10, 10), 0), "b": make(torch.bfloat16, (7,), 1)}
    layout, flat, _ = wire(named, 256)
    views = unpack(layout, flat)
    flat[layout.tensors[0].offset:layout.tensors[0].offset + 4] = 0
    assert views["a"][0, 0].item() == 0.0


def test_tied_weights_are_sent_once_and_stay_tied() -> None:
    w = make(torch.float32, (64, 32), 0)
    named = {"embed": w, "other": make(torch.float32, (5,), 1), "lm_head": w}
    layout, flat, _ = wire(named, 1024)
    assert layout.total_bytes < 2 * w.numel() * 4
    got = unpack(layout, flat)
    assert_same(got, named)
    assert got["embed"].data_ptr() == got["lm_head"].data_ptr()


def test_windows_tile_the_space_with_a_short_ramp() -> None:
    mib = 1 << 20
    w = plan_windows(497 * mib, 256 * mib)
    assert [hi - lo for lo, hi in w][:5] == [16 * mib, 32 * mib, 64 * mib, 128 * mib, 256 * mib]
    assert w[0][0] == 0 and w[-1][1] == 497 * mib and all(a[1] == b[0] for a, b in itertools.pairwise(w))
    assert len(plan_windows(10 * 1024 * mib, 256 * mib)) <= 10 * 4 + 4  # O(total / bucket), not per tensor
    assert plan_windows(0, 4096) == ()
    assert plan_windows(100, 64) == ((0, 64), (64, 100))


def test_number_of_buckets_does_not_grow_with_number_of_tensors() -> None:
    many = {f"n{i}": torch.ones(16) for i in range(2000)}  # 2000 tensors of 64 bytes
    layout = plan_layout(many, 1 << 20)
    assert layout.num_buckets == 1


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["tensors"][0].__setitem__(1, "complex64"), "unsupported dtype"),
    (lambda d: d["tensors"][1].__setitem__(3, 0), "overlaps"),
    (lambda d: d["tensors"][0].__setitem__(4, 999), "inconsistent layout"),
    (lambda d: d.__setitem__("windows", d["windows"][:-1]), "cover"),
    (lambda d: d.__setitem__("windows", [[0, 10**9]]), "tile"),
    (lambda d: d.__setitem__("total_bytes", 8), "inconsistent"),
    (lambda d: d.pop("windows"), "does not parse"),
])
def test_bad_metadata_is_rejected(mutate, message: str) -> None:
    layout = plan_layout({"a": torch.ones(100), "b": torch.ones(50)}, 128)
    doc = json.loads(layout.to_json())
    mutate(doc)
    with pytest.raises(SyncAborted, match=message):
        Layout.from_json(json.dumps(doc).encode())
    with pytest.raises(SyncAborted, match="does not parse"):
        Layout.from_json(b"\xff not json")


def test_bad_input_names_the_tensor() -> None:
    with pytest.raises(SyncError, match="'c'.*complex"):
        plan_layout({"a": torch.ones(2), "c": torch.ones(2, dtype=torch.complex64)}, 1024)
    with pytest.raises(SyncError, match="'x' is a list"):
        plan_layout({"x": [1, 2]}, 1024)  # type: ignore[dict-item]  # bad input on purpose
    with pytest.raises(SyncError, match="at least 64"):
        plan_layout({"a": torch.ones(2)}, 16)


def test_merge_and_split_states() -> None:
    p, d = {"w": torch.ones(2)}, {"fc.w": torch.zeros(3)}
    merged = merge_states(policy=p, drafter=d)
    assert list(merged) == ["policy/w", "drafter/fc.w"]
    assert split_states(merged) == {"policy": p, "drafter": d}
    with pytest.raises(SyncError, match="no '<part>/' prefix"):
        split_states({"w": torch.ones(1)})
    with pytest.raises(SyncError, match="must not contain"):
        merge_states(**{"a/b": p})


def test_flat_source_detects_flattened_state_only() -> None:
    named = {"a": make(torch.float32, (33, 3), 0), "b": make(torch.bfloat16, (5,), 1), "c": torch.ones(7) > 0}
    flat_named = flatten_state(named)
    assert_same(flat_named, named)
    layout = plan_layout(flat_named, 128)
    whole = flat_source(layout, [byte_view(t) for t in flat_named.values()])
    assert whole is not None and whole.numel() == layout.total_bytes
    assert_same(unpack(layout, whole.clone()), named)
    assert flat_source(layout, [byte_view(t) for t in named.values()]) is None  # separate tensors
    reordered = dict(reversed(list(flat_named.items())))
    assert flat_source(plan_layout(reordered, 128), [byte_view(t) for t in reordered.values()]) is None


class Tiny(torch.nn.Module):
    scale: torch.Tensor  # a registered buffer

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("rope_cache", torch.arange(4.0), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.embed(ids))) * self.scale)


def test_flatten_modules_keeps_training_working_and_sends_zero_copy() -> None:
    torch.manual_seed(0)
    policy, drafter = Tiny(), torch.nn.Linear(8, 8)
    before = {k: v.clone() for k, v in merge_states(policy=policy.state_dict(), drafter=drafter.state_dict()).items()}
    views = flatten_modules_(policy=policy, drafter=drafter)
    assert_same(merge_states(policy=policy.state_dict(), drafter=drafter.state_dict()), before)
    assert policy.head.weight is policy.embed.weight
    opt = torch.optim.SGD([*policy.parameters(), *drafter.parameters()], lr=0.1)
    loss = policy(torch.tensor([[1, 2, 3]])).sum() + drafter(torch.ones(1, 8)).sum()
    loss.backward()
    opt.step()
    after = merge_states(policy=policy.state_dict(), drafter=drafter.state_dict())
    assert not torch.equal(after["policy/proj.weight"], before["policy/proj.weight"])
    assert torch.equal(views["policy/proj.weight"], after["policy/proj.weight"])  # updates land in the buffer
    layout = plan_layout(after, 256)
    assert flat_source(layout, [byte_view(t) for t in after.values()]) is not None


def test_versioned_weights_swap_is_atomic_and_monotonic() -> None:
    weights = VersionedWeights(monotonic=True)
    assert weights.current() == (-1, None)
    stop = threading.Event()
    mixed: list[tuple] = []

    def reader() -> None:
        while not stop.is_set():
            version, state = weights.current()
            if state is not None and {state["a"], state["b"]} != {version}:
                mixed.append((version, state))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for v in range(2000):
        weights.swap(v, {"a": v, "b": v})
    stop.set()
    for t in threads:
        t.join()
    assert not mixed and weights.version == 1999
    with pytest.raises(SyncError, match="must increase"):
        weights.swap(1999, {})
    resumed = VersionedWeights(10, {})
    resumed.swap(8, {"a": 8})  # a trainer resumed from an older checkpoint
    assert resumed.version == 8
