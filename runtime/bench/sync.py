"""`specrl bench sync`: weight-sync throughput against the raw loopback TCP bandwidth, measured in one run.

Two processes on 127.0.0.1 (a trainer rank 0 and one rollout receiver). In every repeat they first move the
same number of bytes over a plain TCP socket (one large `sendall`, `recv_into` a pre-touched buffer: the best
the kernel's loopback can do between these two processes right now), then run a real weight sync of a
Llama-shaped policy + EAGLE-style drafter state through `specrl.runtime.sync` (packed buckets over a gloo side
group, atomic swap). Both clocks run on the receiver, from the same barrier to the last byte in place, so the
two numbers are directly comparable. Warm-up rounds of each are not counted (first-touch page faults).
Medians of the repeats are reported; every sample is in the JSON.

Sender modes: "packed" sends the trainer's separate parameter tensors (buckets are packed into staging buffers
while the previous bucket is on the wire); "zero-copy" sends a state whose tensors are views of one buffer
in sync layout, as a trainer gets from `sync.flatten_modules_`, so every bucket leaves straight from the
parameters' memory. The headline (`seconds`, `gbps`, `fraction_of_loopback`) is the first configuration, by
default "zero-copy" at the spec default bucket size (`bucketMiB` 256) -- the path of a trainer that flattened
its modules; `packed_*` keys hold the packed path at the same bucket size. The full run also sweeps smaller
buckets for the packed path.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..ports import free_port

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_MIB = 256  # RLJob spec.weightSync.bucketMiB default
WARMUP = 2  # uncounted rounds per bucket size


@dataclass(frozen=True)
class Workload:
    name: str
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    dtype: str = "bfloat16"


FULL = Workload("llama-250m+eagle", hidden=1024, intermediate=2816, layers=14, vocab=32000)
QUICK = Workload("llama-20m+eagle", hidden=512, intermediate=1408, layers=4, vocab=8000)


def llama_shapes(w: Workload) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Llama decoder (HF names) plus a one-layer EAGLE head, merged as in a sync."""
    h, f = w.hidden, w.intermediate

    def layer(prefix: str) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}.self_attn.q_proj.weight": (h, h), f"{prefix}.self_attn.k_proj.weight": (h, h),
                f"{prefix}.self_attn.v_proj.weight": (h, h), f"{prefix}.self_attn.o_proj.weight": (h, h),
                f"{prefix}.mlp.gate_proj.weight": (f, h), f"{prefix}.mlp.up_proj.weight": (f, h),
                f"{prefix}.mlp.down_proj.weight": (h, f), f"{prefix}.input_layernorm.weight": (h,),
                f"{prefix}.post_attention_layernorm.weight": (h,)}

    shapes: dict[str, tuple[int, ...]] = {"policy/model.embed_tokens.weight": (w.vocab, h)}
    for i in range(w.layers):
        shapes.update(layer(f"policy/model.layers.{i}"))
    shapes["policy/model.norm.weight"] = (h,)
    shapes["policy/lm_head.weight"] = (w.vocab, h)
    shapes["drafter/fc.weight"] = (h, 2 * h)
    shapes.update(layer("drafter/layers.0"))
    return shapes


def build_state(w: Workload, seed: int = 0) -> dict[str, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, w.dtype)
    return {name: torch.empty(shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=gen).to(dtype)
            for name, shape in llama_shapes(w).items()}


Config = tuple[str, int]  # (sender mode, bucket MiB); mode "packed" = separate tensors, "zero-copy" = flattened


def _worker(rank: int, store_port: int, sock_port: int, workload: Workload, configs: list[Config],
            repeats: int, out: Any) -> None:
    try:
        out.put((rank, "ok", _run(rank, store_port, sock_port, workload, configs, repeats)))
    except BaseException as exc:  # noqa: BLE001 -- any failure is reported to the parent, which must not hang
        out.put((rank, "error", f"{type(exc).__name__}: {exc}"))


def _run(rank: int, store_port: int, sock_port: int, w: Workload, configs: list[Config],
         repeats: int) -> dict[str, Any]:
    import torch

    from ..sync import (
        SyncGroup,
        VersionedWeights,
        WeightReceiver,
        WeightSender,
        flatten_state,
        plan_layout,
    )

    torch.set_num_threads(1)
    group = SyncGroup.create("127.0.0.1", store_port, rank=rank, world_size=2, timeout_s=120)
    ping = torch.zeros(1, dtype=torch.int64)

    def barrier() -> None:
        group.allreduce_sum(ping).wait()

    state = build_state(w) if rank == 0 else None  # the sender's weights; None on the receiver
    nbytes = torch.zeros(1, dtype=torch.int64)
    if state is not None:
        nbytes[0] = plan_layout(state, 1 << 20).total_bytes
    group.broadcast(nbytes).wait()
    n = int(nbytes.item())

    # Raw TCP between the same two processes, same byte count.
    raw = torch.empty(n, dtype=torch.uint8)
    raw.fill_(7)  # touch every page before timing
    mv = raw.numpy().data
    if rank == 0:
        srv = socket.create_server(("127.0.0.1", sock_port))
        barrier()
        conn, _ = srv.accept()
        srv.close()
    else:
        barrier()
        conn = socket.create_connection(("127.0.0.1", sock_port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def cpu_seconds() -> float:
        # this process, all threads (gloo's included), user + kernel: what a transfer costs in CPU
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def socket_round() -> tuple[float, float]:
        barrier()
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        if rank == 0:
            conn.sendall(mv)
            conn.recv(1)
        else:
            got = 0
            while got < n:
                # MSG_WAITALL: the kernel fills the rest of the buffer in one call (fewest syscalls and wake-ups)
                r = conn.recv_into(mv[got:], n - got, socket.MSG_WAITALL)
                if r == 0:
                    raise ConnectionError("loopback peer closed early")
                got += r
            conn.sendall(b"k")
        return time.perf_counter() - t0, cpu_seconds() - c0

    results: dict[str, Any] = {"bytes": n, "by_bucket": {}}
    version = 0
    # its buffer pool persists, as in a rollout worker
    receiver = WeightReceiver(group) if state is None else None
    weights = VersionedWeights()
    flat_state: dict[str, torch.Tensor] | None = None
    reference: dict[str, torch.Tensor] | None = None
    for mode, mib in configs:
        if state is not None and mode == "zero-copy" and flat_state is None:
            # What a trainer gets from flatten_modules_: parameters are views of one buffer in sync layout.
            flat_state = flatten_state(state)
        payload = flat_state if mode == "zero-copy" else state  # None on the receiver
        sender = WeightSender(group, bucket_mib=mib) if payload is not None else None
        samples: list[float] = []
        loop_samples: list[float] = []
        buckets = direct = 0
        cpu_loop: list[float] = []
        cpu_sync: list[float] = []
        for rep in range(-WARMUP, repeats):  # warm-up rounds fault in the buffers (the pool holds two)
            lb, lb_cpu = socket_round()
            if rep >= 0:
                loop_samples.append(lb)
                cpu_loop.append(lb_cpu)
            version += 1
            barrier()
            c0 = cpu_seconds()
            t0 = time.perf_counter()
            if sender is not None and payload is not None:
                stats = sender.send(payload, version)
                buckets, direct = stats.buckets, stats.direct_buckets
            elif receiver is not None:
                v, got, stats = receiver.receive()
                weights.swap(v, got)
                buckets = stats.buckets
            dt = time.perf_counter() - t0
            if rep >= 0:
                samples.append(dt)
                cpu_sync.append(cpu_seconds() - c0)
        key = f"{mode}:{mib}"
        cpu = {"cpu_loopback": statistics.median(cpu_loop) / (n / 1e9), "cpu_sync": statistics.median(cpu_sync) / (n / 1e9)}
        if rank == 0:
            results["by_bucket"][key] = {"direct_buckets": direct, **cpu}
        else:
            results["by_bucket"][key] = {"seconds": samples, "loopback_seconds": loop_samples, "buckets": buckets,
                                         **cpu}
            # Not a timing run if the bytes are wrong: every configuration must deliver the same state.
            _, got = weights.current()
            if reference is None:
                reference = {k: v.clone() for k, v in got.items()}
            bad = [k for k in reference if not torch.equal(reference[k], got[k])]
            if bad or set(got) != set(reference):
                raise RuntimeError(f"{key}: received state differs in {len(bad)} tensors, e.g. {bad[:1]}")
    if rank != 0:
        if reference is None:
            raise RuntimeError("no configuration was measured")
        # ... and that state is the sender's (rebuilt from the same seed).
        expect = build_state(w)
        bad = [k for k in expect if not torch.equal(expect[k], reference[k])]
        if bad:
            raise RuntimeError(f"received state differs from the sent one in {len(bad)} tensors, e.g. {bad[0]}")
        results["verified"] = True
    conn.close()
    barrier()
    group.close()
    return results


def run(quick: bool = False, repeats: int | None = None, configs: list[Config] | None = None,
        timeout_s: float = 600.0) -> dict[str, Any]:
    w = QUICK if quick else FULL
    repeats = repeats if repeats is not None else (3 if quick else 7)
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if configs is None:
        configs = [("zero-copy", DEFAULT_BUCKET_MIB), ("packed", DEFAULT_BUCKET_MIB)]
        if not quick:
            configs += [("packed", 64), ("packed", 16)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store_port, sock_port = free_port(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, store_port, sock_port, w, configs, repeats, out), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < 2:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"bench sync: no result within {timeout_s:.0f} s")
            try:
                rank, status, payload = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"bench sync: worker exited with code {dead[0].exitcode}") from None
                continue
            if status != "ok":
                raise RuntimeError(f"bench sync: rank {rank} failed: {payload}")
            reports[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    recv, send = reports[1], reports[0]
    n = recv["bytes"]
    rows = []
    for mode, mib in configs:
        # Each configuration is compared with the loopback rounds interleaved with its own rounds.
        key = f"{mode}:{mib}"
        secs, loop = recv["by_bucket"][key]["seconds"], recv["by_bucket"][key]["loopback_seconds"]
        med, loop_s = statistics.median(secs), statistics.median(loop)
        rows.append({"mode": mode, "bucket_mib": mib, "seconds": med, "gbps": n / med / 1e9, "loopback_seconds": loop_s,
                     "loopback_gbps": n / loop_s / 1e9, "fraction_of_loopback": loop_s / med,
                     # robust to load drifting during the run: each sync against the TCP round just before it
                     "paired_fraction_median": statistics.median(a / b for a, b in zip(loop, secs)),
                     "buckets": recv["by_bucket"][key]["buckets"],
                     "direct_buckets": send["by_bucket"][key]["direct_buckets"], "samples": secs,
                     # CPU seconds per GB moved (all threads, user + kernel): load-independent efficiency
                     "cpu_s_per_gb": {"loopback_sender": send["by_bucket"][key]["cpu_loopback"],
                                      "loopback_receiver": recv["by_bucket"][key]["cpu_loopback"],
                                      "sync_sender": send["by_bucket"][key]["cpu_sync"],
                                      "sync_receiver": recv["by_bucket"][key]["cpu_sync"]},
                     "loopback_samples": loop})
    head = rows[0]
    loop_s = head["loopback_seconds"]
    packed = next((r for r in rows if r["mode"] == "packed"), None)
    packed_keys = {} if packed is None else {
        "packed_seconds": packed["seconds"], "packed_gbps": packed["gbps"],
        "packed_fraction_of_loopback": packed["fraction_of_loopback"], "packed_bucket_mib": packed["bucket_mib"]}
    params = sum(_numel(s) for s in llama_shapes(w).values())
    return {
        "workload": w.name, "dtype": w.dtype, "parameters": params, "bytes": n,
        "seconds": head["seconds"], "gbps": head["gbps"],
        "loopback_seconds": loop_s, "loopback_gbps": n / loop_s / 1e9,
        "fraction_of_loopback": head["fraction_of_loopback"],
        "paired_fraction_median": head["paired_fraction_median"],
        "bucket_mib": head["bucket_mib"], "buckets": head["buckets"], "direct_buckets": head["direct_buckets"],
        "repeats": repeats, "samples": head["samples"], "loopback_samples": head["loopback_samples"],
        "mode": head["mode"], **packed_keys, "configs": rows, "verified": bool(recv.get("verified")), "backend": "gloo",
        "transport": "127.0.0.1 TCP",
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _print(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 140)
    table = Table(title=(f"weight sync vs raw loopback TCP: {result['workload']}, {result['parameters'] / 1e6:.0f}M "
                         f"params {result['dtype']} = {result['bytes'] / 2**20:.0f} MiB; median of "
                         f"{result['repeats']}"))
    for col in ("sender", "bucket MiB", "buckets", "direct", "TCP s", "TCP GB/s", "sync s", "sync GB/s",
                "sync/TCP", "CPU s/GB TCP", "CPU s/GB sync"):
        table.add_column(col, justify="left" if col == "sender" else "right")
    for row in result["configs"]:
        cpu = row["cpu_s_per_gb"]
        table.add_row(row["mode"], str(row["bucket_mib"]), str(row["buckets"]), str(row["direct_buckets"]),
                      f"{row['loopback_seconds']:.3f}", f"{row['loopback_gbps']:.2f}", f"{row['seconds']:.3f}",
                      f"{row['gbps']:.2f}", f"{row['fraction_of_loopback']:.0%}",
                      f"{cpu['loopback_sender']:.2f}+{cpu['loopback_receiver']:.2f}",
                      f"{cpu['sync_sender']:.2f}+{cpu['sync_receiver']:.2f}")
    console.print(table)
    for row in result["configs"]:
        verdict = "meets" if row["fraction_of_loopback"] >= 0.7 else "MISSES"
        console.print(f"{row['mode']} sync, {row['bucket_mib']} MiB buckets: {row['fraction_of_loopback']:.0%} of "
                      f"loopback TCP (paired median {row['paired_fraction_median']:.0%}), {verdict} the 70% target")
    console.print(f"every received state verified against the sent one: {result['verified']}")


def main(args: argparse.Namespace) -> int:
    repeats = getattr(args, "repeats", None)
    if repeats is not None and repeats < 1:
        print(f"specrl bench sync: --repeats must be >= 1, got {repeats}", file=sys.stderr)
        return 2
    from rich.console import Console

    with Console(stderr=True).status("measuring loopback TCP and weight sync between two processes..."):
        try:
            result = run(quick=bool(getattr(args, "quick", False)), repeats=repeats)
        except (RuntimeError, TimeoutError) as exc:
            print(f"specrl bench sync: {exc}", file=sys.stderr)
            return 1
    _print(result)
    path = getattr(args, "json", None)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0
