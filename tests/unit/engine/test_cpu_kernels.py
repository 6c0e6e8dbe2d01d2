"""The CPU decode kernels (runtime/engine/cpu_kernels.py, bfloat16; cpu_kernels_f32.py, float32 on AVX2) against the ATen path they replace: matmuls within one
bfloat16 rounding of a float32 reference and batch-invariant (a row's result does not depend on the rows computed
with it), the fused layer stack within rounding of the per-op path (greedy tokens equal) and, batched, bit-identical
to one sequence at a time, the 4-bit drafter kernel close to its dequantized weights, and quantized_self at batch 1 (where the 4-bit
kernel drafts) still exact under greedy decoding and lossless in law."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from specrl.runtime.engine import (
    RolloutEngine,
    SamplingParams,
    SpeculativeConfig,
    cpu_kernels,
    cpu_kernels_f32,
)
from specrl.runtime.engine.model_runner import Int4Dense, TransformerRunner, native_bf16
from specrl.runtime.engine.proposers.draft_model import DraftModelProposer

from .conftest import VOCAB, make_model, reference_probs

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason="no AVX512-BF16 or no C++ compiler here: the engine runs its ATen path")


needs_f32_kernels = pytest.mark.skipif(not cpu_kernels_f32.available(),
                                       reason="no AVX2/FMA or no C++ compiler here: float32 runs its ATen path")

# the 4-bit drafter's kernels: bfloat16 activations where the CPU has native bf16, float32 on AVX2 CPUs
needs_q4_kernels = pytest.mark.skipif(not (cpu_kernels.available() if native_bf16() else cpu_kernels_f32.available()),
                                      reason="no 4-bit CPU kernels here: quantized_self drafts through ATen")


def test_kernels_build_wherever_the_cpu_and_toolchain_allow() -> None:
    # the other tests skip without the kernels: this one keeps a broken build from passing as "not supported here"
    if cpu_kernels.buildable():
        assert cpu_kernels.available(), "AVX512-BF16, c++ and ninja are here, but the kernels did not build"
    if cpu_kernels_f32.buildable():
        assert cpu_kernels_f32.available(), "AVX2, FMA, c++ and ninja are here, but the float32 kernels did not build"


def test_kernels_are_cached_with_specrl_s_cache_a_pod_mounts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a pod's HOME is new at every start; its SPECRL_CACHE_DIR is the model-cache volume the job's pods share
    monkeypatch.delenv("SPECRL_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("SPECRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    build = cpu_kernels.build_folder("specrl_decode_kernels")
    assert build.parent.parent == tmp_path / "cache" / "kernels" and build.name == "specrl_decode_kernels"
    assert not (tmp_path / "cache").exists()  # only a build creates it
    other = cpu_kernels.build_folder("specrl_decode_kernels_f32")
    assert other.parent == build.parent and other != build  # one folder per CPU flags, one per extension
    monkeypatch.setenv("SPECRL_KERNEL_CACHE", str(tmp_path / "k"))
    assert cpu_kernels.build_folder("specrl_decode_kernels").parent.parent == tmp_path / "k"


@pytest.mark.slow
@needs_f32_kernels
def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch guards a build with a lock file it deletes at the end: a process killed mid-build (Ctrl-C during the
    # first `specrl run`) left it behind, and every later process waited for it forever. The next one must build.
    monkeypatch.setenv("SPECRL_KERNEL_CACHE", str(tmp_path))
    build = cpu_kernels.build_folder("specrl_decode_kernels_f32")
    build.mkdir(parents=True)
    (build / "lock").touch()
    code = "import sys; from specrl.runtime.engine import cpu_kernels_f32 as k; sys.exit(0 if k.load() else 3)"
    proc = subprocess.run([sys.executable, "-c", code], check=False, env=dict(os.environ), timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (build / "lock").exists() and any(build.glob("*.so"))


@needs_f32_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 19])
def test_linear_f32_is_the_float32_product(rows: int) -> None:
    # 203 columns: a partial block; 520 inputs: two full 256-input slices and a partial one
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(203, 520, generator=g), torch.randn(203, generator=g), torch.randn(rows, 520, generator=g)
    y = cpu_kernels_f32.load().linear(x, cpu_kernels_f32.pack_f32(w), b, 203)
    ref = (x.double() @ w.double().t() + b.double()).float()
    assert y.dtype == torch.float32 and y.shape == (rows, 203)
    assert torch.allclose(y, ref, rtol=1e-5, atol=2e-4)


@needs_f32_kernels
def test_linear_f32_takes_an_odd_number_of_inputs() -> None:
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(13, 301, generator=g), torch.randn(3, 301, generator=g)
    assert cpu_kernels_f32.fits(w)
    y = cpu_kernels_f32.load().linear(x, cpu_kernels_f32.pack_f32(w), None, 13)
    assert torch.allclose(y, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-4)


@needs_f32_kernels
def test_linear_f32_rows_do_not_depend_on_the_batch() -> None:
    # rows go in chunks of 6 over pairs of 8-column blocks (70 columns: a lone partial last block) and slices of 256
    # inputs, a row's partial sums stored between slices (600 inputs: a partial last slice)
    g = torch.Generator().manual_seed(5)
    w = cpu_kernels_f32.pack_f32(torch.randn(70, 600, generator=g))
    x = torch.randn(21, 600, generator=g)
    k = cpu_kernels_f32.load()
    alone = torch.cat([k.linear(x[i : i + 1], w, None, 70) for i in range(21)])
    for rows in (2, 4, 5, 6, 7, 8, 13, 21):
        assert torch.equal(k.linear(x[:rows], w, None, 70), alone[:rows]), rows


def _fused_runner(kind: str, seed: int, dtype: torch.dtype) -> TransformerRunner:
    if not (cpu_kernels if dtype == torch.bfloat16 else cpu_kernels_f32).available():
        pytest.skip(f"no {dtype} CPU kernels here")
    runner = TransformerRunner(make_model(kind, layers=2, hidden=64, seed=seed), dtype=dtype)
    assert runner._fused is not None
    return runner


@pytest.fixture(params=["vdpbf16ps", "amx"])
def matmul_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both ways the bfloat16 kernels multiply: `vdpbf16ps` tiles everywhere, AMX tiles where the CPU has them."""
    if not cpu_kernels.available():
        if request.param == "amx":
            pytest.skip("no AVX512-BF16 or no C++ compiler here: the engine runs its ATen path")
        yield request.param
        return
    before = cpu_kernels.amx()
    if cpu_kernels.use_amx(request.param == "amx") != (request.param == "amx"):
        cpu_kernels.use_amx(before)
        pytest.skip("no AMX here (CPU, compiler or OS)")
    yield request.param
    cpu_kernels.use_amx(before)


def test_amx_is_used_where_the_cpu_has_it() -> None:
    if not cpu_kernels.available():
        pytest.skip("no AVX512-BF16 or no C++ compiler here")
    before = cpu_kernels.amx()
    try:
        assert cpu_kernels.use_amx(False) is False and not cpu_kernels.amx()
        on = cpu_kernels.use_amx(True)
        assert on == cpu_kernels.amx()
        if "amx_bf16" in cpu_kernels.cpu_flags().split() and os.environ.get("SPECRL_AMX", "1") != "0":
            # a kernel could refuse the tile state; on the Linux machines we run on it grants it
            assert on, "the CPU has AMX but the kernels do not use it"
    finally:
        cpu_kernels.use_amx(before)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 19, 40])
def test_linear_bf16_is_the_rounded_float32_product(rows: int, matmul_path: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 96, generator=g).to(torch.bfloat16)
    b = torch.randn(200, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    y = cpu_kernels.load().linear(x, cpu_kernels.pack_bf16(w), b, 200)
    ref = x.float() @ w.float().t() + b.float()
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 200)
    assert torch.allclose(y.float(), ref, rtol=2 ** -7, atol=1e-3)


@needs_kernels
def test_linear_bf16_rows_do_not_depend_on_the_batch(matmul_path: str) -> None:
    # rows go in chunks of up to 6 (AMX: pairs of 16-row tiles, then one, padded) against tiles of a group of 4
    # column blocks (AMX pairs: 2), the narrower last group a block at a time (70 columns: a group and a partial
    # block): every row must round as it does alone
    g = torch.Generator().manual_seed(5)
    w = cpu_kernels.pack_bf16(torch.randn(70, 128, generator=g).to(torch.bfloat16))
    x = torch.randn(83, 128, generator=g).to(torch.bfloat16)
    k = cpu_kernels.load()
    alone = torch.cat([k.linear_bf16(x[i : i + 1], w, None, 70) for i in range(83)])
    for rows in (2, 4, 5, 7, 8, 9, 16, 17, 21, 32, 37, 48, 64, 83):
        assert torch.equal(k.linear_bf16(x[:rows], w, None, 70), alone[:rows]), rows


@needs_kernels
@pytest.mark.parametrize("head_dim", [16, 64, 128, 48])  # 48: not a whole number of vector registers' worth
def test_attention_is_the_softmax_of_its_scores_at_every_context_length(head_dim: int) -> None:
    """`attend` (the attention of every fused forward) against float64 at contexts of 1 to 70 positions: the scores
    go 16 positions at a time with the rest one by one, so every split of a context into blocks and a tail is
    crossed; and a query's output is the same whatever else is in the call (a verification's tokens, other rows)."""
    kernels = cpu_kernels.load()
    g = torch.Generator().manual_seed(11)
    nh, nkv, max_len, scaling = 6, 2, 80, head_dim ** -0.5
    kc = torch.randn(3, nkv, max_len, head_dim, generator=g).to(torch.bfloat16)
    vc = torch.randn(3, nkv, max_len, head_dim, generator=g).to(torch.bfloat16)
    q = (2 * torch.randn(2, nh, 5, head_dim, generator=g)).to(torch.bfloat16)
    for start in (0, 11, 15, 16, 31, 32, 47, 65):
        positions = torch.tensor([[start + t for t in range(5)], [min(start + 3 + t, 79) for t in range(5)]])
        out = kernels.attend(q, kc, vc, 1, positions, max_len, scaling).double()
        for b in range(2):
            for h in range(nh):
                k, v = kc[1 + b, h // (nh // nkv)].double(), vc[1 + b, h // (nh // nkv)].double()
                for t in range(5):
                    n = int(positions[b, t]) + 1
                    w = torch.softmax((q[b, h, t].double() * scaling) @ k[:n].t(), dim=-1)
                    ref = w @ v[:n]
                    assert torch.allclose(out[b, h, t], ref, rtol=2e-2, atol=2e-2), (start, b, h, t)
        # one token of one row alone computes what it computed beside the others
        alone = kernels.attend(q[1:, :, 2:3], kc, vc, 2, positions[1:, 2:3], max_len, scaling)
        assert torch.equal(alone, out[1:, :, 2:3].to(torch.bfloat16))


@needs_kernels
def test_linear_q4_matches_its_dequantized_weights() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g)
    dense = Int4Dense(w, None)
    assert dense.kernels is not None
    x = torch.randn(1, 128, generator=g).to(torch.bfloat16)
    grouped = w.view(96, 4, 32)  # 6 blocks of 16 columns: a group of 4 and a narrower last group of 2
    mn = grouped.amin(-1, keepdim=True).bfloat16().float()
    s = ((grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)) / 15).clamp(min=1e-8)
    q = torch.round((grouped - grouped.amin(-1, keepdim=True)) / s).clamp(0, 15)
    ref = x.float() @ (q * s.bfloat16().float() + mn).view(96, 128).t()
    y = dense(x).float()
    assert float((y - ref).norm() / ref.norm()) < 0.03  # activations are int16 per group of 32


@needs_kernels
def test_linear_q4_rows_do_not_depend_on_the_batch() -> None:
    # one row runs against a whole group of blocks a tile, more rows two at a time against two blocks: every row
    # must come out as it does alone (drafting is batch-invariant); 208 columns: three groups of 4 blocks and one of 1
    g = torch.Generator().manual_seed(3)
    dense = Int4Dense(torch.randn(208, 128, generator=g), None)
    x = torch.randn(7, 128, generator=g).to(torch.bfloat16)
    k = cpu_kernels.load()
    args = (*dense.q4_packed, None, 208)
    alone = torch.cat([k.linear_q4(x[i : i + 1], *args) for i in range(7)])
    for rows in (2, 3, 5, 7):
        assert torch.equal(k.linear_q4(x[:rows], *args), alone[:rows]), rows


def test_the_prefetch_distance_is_the_one_measured_for_the_cpu() -> None:
    mib = 2**20
    zen4 = ("AuthenticAMD", "25", 32 * mib)
    assert cpu_kernels.prefetch_distance(55 * mib, *zen4) == (8192, 0)  # the bench model: one-row steps want it
    assert cpu_kernels.prefetch_distance(101 * mib, *zen4) == (8192, 0)  # up to NEAR_L3 times the L3
    assert cpu_kernels.prefetch_distance(115 * mib, *zen4) == (0, 0)  # SmolLM2's first 9 layers: 0.97x with it
    assert cpu_kernels.prefetch_distance(269 * mib, *zen4) == (0, 0)  # SmolLM2: the prefetches only slowed it
    assert cpu_kernels.prefetch_distance(None, *zen4) == (0, 0)  # a model's size unknown
    assert cpu_kernels.prefetch_distance(55 * mib, "AuthenticAMD", "25", l3=0) == (0, 0)  # no L3 size from the OS
    for vendor, family in (("AuthenticAMD", "26"), ("GenuineIntel", "6"), ("", "")):  # Zen 5, not measured, none
        assert cpu_kernels.prefetch_distance(55 * mib, vendor, family, 32 * mib) == (8192, 8192)


@pytest.mark.parametrize(("text", "size"), [("32768K", 32 * 2**20), ("1M", 2**20), ("512", 512), ("", 0), ("?K", 0)])
def test_the_l3_size_is_read_as_the_os_writes_it(text: str, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda p, *a, **k: text + "\n" if p.name == "size" else real(p, *a, **k))
    assert cpu_kernels.l3_bytes() == size


@needs_kernels
def test_prefetching_never_changes_a_product() -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(208, 256, generator=g)
    packed, dense = cpu_kernels.pack_bf16(w.to(torch.bfloat16)), Int4Dense(w, None)
    x = torch.randn(7, 256, generator=g).to(torch.bfloat16)
    k = cpu_kernels.load()
    try:
        outs = []
        for ahead in ((0, 0), (64, 0), (8192, 0), (0, 8192), (8192, 8192)):
            k.set_prefetch(*ahead)
            outs.append((k.linear_bf16(x, packed, None, 208), k.linear_q4(x, *dense.q4_packed, None, 208),
                         k.linear_bf16(x[:1], packed, None, 208)))
        for got in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))
    finally:
        k.set_prefetch(*cpu_kernels.prefetch_distance())


@needs_kernels
def test_each_runner_sets_the_prefetch_its_weights_size_calls_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' setting is the process's: a runner sets its own before each fused forward, so a drafter and
    its policy of different sizes each stream with theirs."""
    measured = cpu_kernels.prefetch_distance
    sizes: list[int | None] = []

    def distance(size: int | None = None) -> tuple[int, int]:
        sizes.append(size)
        return 100 + len(sizes), 7

    monkeypatch.setattr(cpu_kernels, "prefetch_distance", distance)
    runner = _fused_runner("llama", 1, torch.bfloat16)
    # [N, K] of qkv, o, gate_up, down (hidden 64, 2 of 4 heads for k and v, intermediate 128) and the lm_head,
    # bfloat16 with N padded to blocks of 16
    shapes = [(64 + 2 * 32, 64), (64, 64), (2 * 128, 64), (64, 128)] * 2 + [(VOCAB, 64)]
    assert sizes == [sum(2 * 16 * -(-n // 16) * k for n, k in shapes)]
    assert runner.prefetch == (101, 7)  # what the bench records beside its numbers
    k = cpu_kernels.load()
    real, seen = k.set_prefetch, []

    def set_prefetch(one: int, rows: int) -> list[int]:
        seen.append((one, rows))
        return real(one, rows)

    monkeypatch.setattr(k, "set_prefetch", set_prefetch)
    try:
        with torch.inference_mode():
            cache = runner.new_cache(1, 16)
            runner.forward(cache, 0, [0], torch.tensor([[1, 2, 3]]))
            runner.forward(cache, 0, [3], torch.tensor([[4]]))
        assert seen == [(101, 7)] * 2
    finally:
        real(*measured())


@needs_f32_kernels
@pytest.mark.skipif(native_bf16(), reason="CPUs with native bf16 draft in bfloat16 (the test above)")
@pytest.mark.parametrize("shape", [(96, 128), (203, 544), (70, 32)])
def test_linear_q4_f32_matches_its_dequantized_weights(shape: tuple[int, int]) -> None:
    # any number of outputs (blocks of 8, a partial last one), inputs in whole groups of 32
    n, k = shape
    g = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    dense = Int4Dense(w, bias)
    assert dense.kernels is cpu_kernels_f32.load() and dense.packed is None  # every row through the kernel
    # the codes as Int4Dense rounds them (float32 scale), dequantized with the stored bfloat16 scale and min
    grouped = w.view(n, k // 32, 32)
    lo = grouped.amin(-1, keepdim=True)
    q = torch.round((grouped - lo) / ((grouped.amax(-1, keepdim=True) - lo) / 15)).clamp(0, 15)
    assert dense.q4_sz is not None  # the float32 module keeps scales and mins apart
    s, mn = (t.transpose(1, 2).reshape(-1, k // 32)[:n] for t in dense.q4_sz.float())  # [blocks, G, 8] -> [N, G]
    deq = (q * s.unsqueeze(-1) + mn.unsqueeze(-1)).view(n, k)
    x = torch.randn(7, k, generator=g)
    y = dense(x)
    assert y.dtype == torch.float32 and y.shape == (7, n)
    # exactly what the kernel computes: activations rounded to int8 per group of 32 (scale max|x| / 127), the codes'
    # products with them summed as integers, the mins applied to the unrounded activations
    xg = x.view(7, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    x8 = torch.round(xg * (127 / amax)).double()
    xs = (amax / 127).double()
    sums = torch.einsum("mgk,ngk->mng", x8, q.double())  # exact integers
    ref = (sums * (s.double().unsqueeze(0) * xs.squeeze(-1).unsqueeze(1))).sum(-1) \
        + xg.double().sum(-1) @ mn.double().t() + bias.double()
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-5  # float32 roundings only
    full = x.double() @ deq.double().t() + bias.double()  # and close to the unrounded activations' product
    assert float((y.double() - full).norm() / full.norm()) < 2e-2
    # a row's result does not depend on the rows computed with it (pairs of rows share the unpacked codes)
    alone = torch.cat([dense(x[i : i + 1]) for i in range(7)])
    for rows in (2, 3, 5, 7):
        assert torch.equal(dense(x[:rows]), alone[:rows]), rows
    assert torch.equal(dense(x.view(7, 1, k)), alone.view(7, 1, n))  # any leading shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_decode_step_matches_the_per_op_path(kind: str, dtype: torch.dtype) -> None:
    runner = _fused_runner(kind, 3, dtype)
    fused = runner._fused
    runs, fed = [], [5, 9, 2, 14, 7, 7, 3, 11]  # the same tokens through both paths
    for use in (None, fused):
        runner._fused = use
        cache = runner.new_cache(1, 32)
        with torch.inference_mode():
            runner.forward(cache, 0, [0], torch.tensor([[1, 2, 3, 4]]))
            out = [runner.forward(cache, 0, [4 + i], torch.tensor([[t]]))[0][0, 0].clone() for i, t in enumerate(fed)]
        runs.append((out, cache.k[0][0, :, :12].float().clone()))
    (a, ka), (b, kb) = runs
    # bfloat16: a few roundings apart; float32: only the order of additions differs
    rel, tol = (0.02, 2 ** -7) if dtype == torch.bfloat16 else (1e-5, 1e-5)
    for la, lb in zip(a, b):
        err = float((la - lb).abs().max())
        assert err <= rel * float(la.abs().max()) + rel * 2.5
        top = la.topk(2).values
        assert int(la.argmax()) == int(lb.argmax()) or float(top[0] - top[1]) <= 2 * err  # only near-ties differ
    # the first layer's keys (norm, qkv, rotary, cache write) as the per-op path computes them
    assert torch.allclose(ka, kb, rtol=tol, atol=1e-3 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batched_fused_forward_is_each_sequence_alone(dtype: torch.dtype, matmul_path: str) -> None:
    """B sequences at different lengths, S tokens each (a batched decode step or verification), in one fused call:
    logits and the K/V cache bit-identical to running each sequence by itself."""
    if dtype == torch.float32 and matmul_path == "amx":
        pytest.skip("AMX multiplies bfloat16 only")
    runner = _fused_runner("llama", 6, dtype)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=g) for n in (3, 9, 5, 12)]
    for s in (1, 4, 9):  # 4, 16 and 36 rows: on AMX one tile of rows, one, and a pair of tiles and one more
        new = torch.randint(1, VOCAB, (len(prompts), s), generator=g)
        starts = [p.shape[1] for p in prompts]
        with torch.inference_mode():
            together = runner.new_cache(4, 40)
            alone = runner.new_cache(4, 40)
            for slot, p in enumerate(prompts):
                for cache in (together, alone):
                    runner.forward(cache, slot, [0], p)
            batched = runner.forward(together, 0, starts, new)[0]
            single = torch.cat([runner.forward(alone, slot, [starts[slot]], new[slot : slot + 1])[0]
                                for slot in range(len(prompts))])
        assert batched.shape == (4, s, single.shape[-1])
        assert torch.equal(batched, single)
        assert all(torch.equal(a, b) for a, b in zip(together.k + together.v, alone.k + alone.v))


@pytest.fixture(scope="module")
def wide_target() -> torch.nn.Module:
    # hidden 64: every matrix takes the 4-bit kernel's layout (input features a multiple of 64)
    return make_model("llama", layers=2, hidden=64, seed=4, head_std=0.5)


@needs_q4_kernels
def test_quantized_self_at_batch_1_greedy_equals_plain(wide_target: torch.nn.Module) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    plain = RolloutEngine(wide_target, max_batch_size=1, dtype="auto").generate(prompts, params)
    engine = RolloutEngine(wide_target, SpeculativeConfig(method="quantized_self", num_speculative_tokens=3),
                           max_batch_size=1, dtype="auto")
    drafter = engine.proposers["quantized_self"]
    assert isinstance(drafter, DraftModelProposer) and drafter.runner is not None
    assert drafter.runner._fused is not None  # the 4-bit batch-1 kernels draft
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
    assert engine.stats.draft_tokens > 0


@needs_q4_kernels
def test_quantized_self_at_batch_1_is_lossless(wide_target: torch.nn.Module) -> None:
    """Three-token continuations drawn one sequence at a time (so every draft goes through the 4-bit batch-1
    kernel) against the exact law of the engine's own target (chi-square, top-k 2: 8 outcomes)."""
    n, k, top_k, prompt = 300, 3, 2, [3, 1, 4]
    engine = RolloutEngine(wide_target, SpeculativeConfig(method="quantized_self", num_speculative_tokens=2),
                           max_batch_size=1, dtype="auto")
    outs = engine.generate([prompt] * n, [SamplingParams(temperature=1.0, top_k=top_k, max_new_tokens=k, seed=s)
                                          for s in range(n)])
    assert engine.stats.draft_tokens > engine.stats.accepted_tokens > 0
    runner = TransformerRunner(wide_target, dtype="auto")  # the engine's own target
    law: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(k):
            new: dict[tuple[int, ...], float] = {}
            for ctx, p in law.items():
                ids = prompt + list(ctx)
                logits = runner.forward(runner.new_cache(1, 8), 0, [0], torch.tensor([ids]))[0][0, -1]
                probs = reference_probs(logits.double().numpy()[None], 1.0, top_k, 1.0)[0]
                new.update({ctx + (int(t),): p * float(probs[t]) for t in np.nonzero(probs)[0]})
            law = new
    samples = [tuple(o.token_ids) for o in outs]
    assert all(s in law for s in samples)
    keys = [s for s, p in law.items() if p * n >= 5]
    observed = [samples.count(s) for s in keys] + [sum(1 for s in samples if s not in keys)]
    expected = [law[s] * n for s in keys] + [n - sum(law[s] * n for s in keys)]
    if expected[-1] < 1e-6:
        observed, expected = observed[:-1], expected[:-1]
    assert stats.chisquare(observed, np.array(expected) * sum(observed) / sum(expected)).pvalue > 1e-3
