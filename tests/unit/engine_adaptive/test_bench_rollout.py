"""`specrl bench rollout --quick --json` runs end to end and writes every key other tools read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from specrl.runtime.cli import main


def test_quick_bench_writes_all_keys(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "rollout", "--quick", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    for key in ("configs", "adaptive", "engine_bs1", "hf", "roofline_fraction_bs1", "lossless", "model", "sweep",
                "calibration", "targets"):
        assert key in r, key
    names = {c["name"] for c in r["configs"]}
    assert {"ar", "draft_model-g2", "draft_model-g4", "draft_model-g6", "ngram-g4", "layer_skip-g4",
            "quantized_self-g4"} <= names
    for c in r["configs"]:
        assert {"name", "method", "batch_size", "tokens_per_s", "acceptance_length", "speedup_vs_ar"} <= set(c)
        assert c["tokens_per_s"] > 0 and c["batch_size"] == 16
        assert c["target_forwards_per_token"] > 0 and c["tail_seconds"] >= 0
    ar = next(c for c in r["configs"] if c["name"] == "ar")
    assert ar["speedup_vs_ar"] == pytest.approx(1.0) and ar["acceptance_length"] is None
    assert ar["target_forwards_per_token"] == pytest.approx(1.0)
    sd = next(c for c in r["configs"] if c["name"] == "draft_model-g4")
    assert 1.0 <= sd["acceptance_length"] <= 5.0
    assert sd["target_forwards_per_token"] < ar["target_forwards_per_token"] + 1e-9 or sd["acceptance_length"] < 1.5
    assert r["adaptive"]["tokens_per_s"] > 0 and r["adaptive"]["speedup_vs_ar"] > 0
    assert r["adaptive"]["controller"]["steps"] > 0
    assert r["engine_bs1"]["ar_tokens_per_s"] > 0 and r["engine_bs1"]["sd_tokens_per_s"] > 0
    assert r["hf"]["ar_batched_tokens_per_s"] > 0 and r["hf"]["assisted_bs1_tokens_per_s"] > 0
    assert 0 < r["roofline_fraction_bs1"] < 1.5 and 0 < r["roofline_fraction_bs1_end_to_end"] < 1.5
    assert r["engine_bs1"]["ar_decode_tokens_per_s"] > 0  # the rate the roofline bounds: prefill left out
    # one roofline per plain batch-1 run, from the bandwidth measured around it
    assert len(r["roofline"]["fraction_per_run"]) == len(r["roofline"]["bandwidth_per_run_gb_s"]) == r["repeats"]
    assert r["model"]["parameters"] > 0 and r["model"]["trained_steps"] == 0  # quick: random-init
    assert r["lossless"]["passed"] is True
    assert all(0.0 <= p <= 1.0 and not math.isnan(p) for p in r["lossless"]["p_values"].values())
    assert {row["batch_size"] for row in r["sweep"]} == {1, 3}
    for row in r["sweep"]:
        assert row["best_fixed"] in row["tokens_per_s"] and row["adaptive_vs_best"] > 0
        assert set(row["tokens_per_s_spread"]) == set(row["tokens_per_s"]) and row["adaptive_vs_best_per_repeat"]
        assert row["adaptive_vs_best_interval"] is None  # one repeat: no interval (`ratio_interval`)
        # what the policy ran at exactly this batch size in the sweep: options the engine has
        assert row["adaptive_ran"] and all(k == "ar" or k.split(":")[0] in r["proposers"]["available"]
                                           for k in row["adaptive_ran"])
        # the policy's predictions beside the fixed configurations' measurements, both against plain decoding
        assert row["measured_vs_plain"]["ar"] == 1.0 and set(row["measured_vs_plain"]) <= set(row["tokens_per_s"])
        [predicted] = row["predicted_vs_plain_per_repeat"]  # one repeat
        assert predicted["ar"] == 1.0 and all(v > 0 for v in predicted.values())
        assert {k.split(":")[0] for k in predicted} - {"ar"} <= set(r["proposers"]["available"])
    # what could explain a different result elsewhere, and the spread of repeats next to each median
    m = r["machine"]
    assert m["threads"] >= 1 and m["engine_dtype"].startswith("torch.") and "load_average_end" in m
    assert len(r["model"]["digest"]) == 16 and r["model"]["digest"] != r["model"]["draft_digest"]
    assert r["lockstep_slice_s"] == 0.05  # the lockstep's turns (`lockstep.py`, "why slices")
    assert r["workload"]["rollout_step"] == 16 and 0 <= r["workload"]["ar_tail_share"] <= 1
    assert r["serving"]["ar_tokens_per_s"] > 0 and r["serving"]["adaptive_vs_ar"]["ratio"] > 0
    lengths = r["workload"]["response_length"]
    assert lengths["median"] <= lengths["p95"] <= lengths["max"]
    assert all(c["tokens_per_s_spread"][0] - 1e-3 <= c["tokens_per_s"] <= c["tokens_per_s_spread"][1] + 1e-3
               for c in r["configs"])
    assert r["adaptive"]["vs_best_fixed"]["best_fixed"] in names and r["adaptive"]["vs_best_fixed"]["ratio"] > 0
    mix = r["common_mix"]
    assert mix["best_fixed"] in names and mix["buckets"] and len(mix["reference_tokens"]) == len(mix["buckets"])
    assert set(mix["tokens_per_cpu_s_by_bucket"]) == {*names, "adaptive"}
    assert all(len(v) == len(mix["buckets"]) for v in mix["tokens_per_cpu_s_by_bucket"].values())
    # the policy's own CPU time, beside a fixed configuration's (a constant choice: next to nothing)
    ada, plain = r["adaptive"], next(c for c in r["configs"] if c["name"] == "ar")
    assert 0 <= plain["policy_us_per_step"] < ada["policy_us_per_step"] and 0 < ada["policy_cpu_share"] < 1
    assert sum(t for run in ada["runs_by_batch"] for t, _ in run.values()) > 0
    assert r["targets"]["adaptive_vs_best_fixed"]["value"] == mix["adaptive_vs_best_fixed"]["ratio"] > 0
    assert mix["adaptive_vs_held_out_best"] is None and mix["held_out_best_per_repeat"] == []  # one repeat
    assert mix["fixed_on_other_texts"]["ratios"] == []  # the control runs from the second repeat on
    assert r["workload"]["sampling_seed"] == r["workload"]["seed"]  # no --seed: the workload's


def test_bench_helpers() -> None:
    from specrl.runtime.bench.rollout import engine_bytes_per_step, length_stats, spread
    from specrl.runtime.engine import RolloutEngine
    from transformers import LlamaConfig, LlamaForCausalLM

    assert length_stats([1] * 19 + [101]) == {"median": 1, "p95": 101, "max": 101, "mean": 6.0}
    assert spread([3.0, None, 1.0, 2.0]) == [1.0, 3.0] and spread([]) is None
    cfg = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())  # the tied matrix counts once here
    engine = RolloutEngine(model, max_batch_size=1, dtype="float32")
    # every weight once, one embedding row, plus the tied lm_head read in full
    assert engine_bytes_per_step(engine) == 4 * (params - 100 * 16 + 16 + 100 * 16)


def test_bandwidth_pairs_rate_each_run_against_its_own_minute() -> None:
    from specrl.runtime.bench.rollout import BandwidthPairs

    pairs = BandwidthPairs(megabytes=8)
    pairs.bandwidths = [10.0, 20.0]  # GB/s around two runs
    # 100 MB a step: rooflines of 100 and 200 tok/s; the same 80 tok/s is 80% of the first and 40% of the second
    assert pairs.fractions([80.0, 80.0], 100_000_000) == pytest.approx([0.8, 0.4])
    pairs.before()
    pairs.after()
    assert len(pairs.bandwidths) == 3 and pairs.bandwidths[-1] > 0


def test_common_mix_compares_rates_not_tails() -> None:
    # Two configurations with the same rate at every batch size; one drew a longer tail (more tokens at batch 1,
    # the slowest). Raw tokens/s tells them apart; on the common mix they are equal. A bucket one of them never
    # reached does not count.
    from specrl.runtime.bench.rollout import RunResult, mix_rates

    def run(by_batch: dict[int, list[float]]) -> RunResult:
        tokens = sum(v[0] for v in by_batch.values())
        cpu = sum(v[1] for v in by_batch.values())
        return RunResult(tokens=int(tokens), seconds=cpu, cpu_seconds=cpu, acceptance_length=None,
                         forwards_per_token=1.0, tail_seconds=0.0, by_batch=by_batch)

    short = run({1: [10, 0.2, 0.2], 16: [1000, 2.0, 2.0]})
    long = run({1: [60, 1.2, 1.2], 16: [1000, 2.0, 2.0]})
    fast = run({1: [10, 0.1, 0.1], 16: [1000, 1.0, 1.0], 4: [40, 0.1, 0.1]})
    assert long.tokens_per_s < 0.8 * short.tokens_per_s
    out = mix_rates({"ar": [short], "same_rates": [long], "twice_as_fast": [fast]}, "ar")
    rates = out["tokens_per_cpu_s"]
    assert rates["same_rates"] == rates["ar"] == 1010 / 2.2
    assert rates["twice_as_fast"] == 2 * rates["ar"]
    assert out["buckets"] == [[1, 1], [16, 16]] and out["reference_tokens"] == [10, 1000]


def test_the_leading_fixed_configuration_against_itself_on_other_texts() -> None:
    # The control of the long-tail ring: from the second repeat on, the configuration the earlier repeats rank best
    # also runs on texts of its own; each repeat's ratio is its common-mix rate there against its rate on the
    # repeat's texts, whatever the other configurations did.
    from specrl.runtime.bench.rollout import RunResult, _leader, other_texts, sampling

    def run(rate_1: float, rate_16: float) -> RunResult:
        by_batch = {1: [10.0, 10.0 / rate_1, 0.0], 16: [100.0, 100.0 / rate_16, 0.0]}
        return RunResult(tokens=110, seconds=1.0, cpu_seconds=sum(v[1] for v in by_batch.values()),
                         acceptance_length=None, forwards_per_token=1.0, tail_seconds=0.0, by_batch=by_batch)

    runs = {"ar": [run(10, 100), run(10, 100), run(10, 100)],
            "g4": [run(20, 200), run(20, 150), run(20, 150)],
            "g6": [run(30, 150), run(30, 200), run(30, 200)]}
    assert _leader({n: rs[:1] for n, rs in runs.items()}, ["g4", "g6"]) == "g6"
    assert _leader({"ar": runs["ar"][:1], "g4": [run(40, 400)], "g6": runs["g6"][:1]}, ["g4", "g6"]) == "g4"
    same, slower = run(30, 200), run(15, 200)  # g6 on other texts: the same rates, then half as fast at batch 1
    out = other_texts(runs, [("g6", same), ("g6", slower)])
    assert out["configs"] == ["g6", "g6"] and out["ratios"][0] == 1.0
    # mix: 10 tokens at batch 1 and 100 at 16: 110 / (10/30 + 100/200) against 110 / (10/15 + 100/200)
    assert out["ratios"][1] == pytest.approx(round((10 / 30 + 0.5) / (10 / 15 + 0.5), 3))
    assert out["interval"] is not None
    assert other_texts(runs, [])["ratios"] == [] and other_texts(runs, [])["interval"] is None
    # the seed moves every sampling seed, the prompts stay
    assert [p.seed for p in sampling(2, 8, None, offset=1000, seed=7)] == [1007, 1008]


def test_held_out_best_removes_the_winners_curse() -> None:
    # Two fixed configurations with the same true rate and the adaptive runs a copy of one of them: ranked on the
    # same runs the best reads above the true rate and the ratio reads low; ranked on the other repeats it does not.
    import random
    import statistics

    from specrl.runtime.bench.rollout import held_out_best

    rng = random.Random(3)
    raw, held = [], []
    for _ in range(400):
        rates = {name: [1000 * (1 + rng.gauss(0, 0.06)) for _ in range(4)] for name in ("a", "b", "adaptive")}
        raw.append(statistics.median(rates["adaptive"]) / max(statistics.median(rates[f]) for f in ("a", "b")))
        held.append(held_out_best(rates, ["a", "b"])["adaptive_vs_held_out_best"])
    assert statistics.mean(raw) < 0.985 and abs(statistics.mean(held) - 1) < 0.005
    # the pick for a repeat comes from the others only
    out = held_out_best({"a": [1.0, 9.0, 9.0], "b": [5.0, 1.0, 1.0], "adaptive": [2.0, 3.0, 3.0]}, ["a", "b"])
    assert [p for p, _ in out["held_out_best_per_repeat"]] == ["a", "a", "a"]
    assert out["adaptive_vs_held_out_best"] == pytest.approx(1 / 3)
    assert held_out_best({"a": [1.0], "adaptive": [1.0]}, ["a"])["adaptive_vs_held_out_best"] is None


def test_rollout_steps_admit_prompts_together_and_shrink() -> None:
    # As a synchronous rollout: each step's prompts start together and the next step waits for its longest
    # response, so the batch only shrinks within a step; the serving shape refills freed slots from the queue.
    import torch
    from specrl.runtime.bench.rollout import run_engine
    from specrl.runtime.engine import RolloutEngine, SamplingParams
    from specrl.runtime.engine.control import FixedController
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2)).eval()
    engine = RolloutEngine(model, max_batch_size=12, dtype="float32", seed=0)
    prompts = [[1, 2, 3]] * 20
    params = [SamplingParams(temperature=1.0, max_new_tokens=2 + 3 * (i % 10), seed=i) for i in range(20)]

    stepped = run_engine(engine, FixedController(None), prompts, params, step_size=10)
    sizes = [s.batch_size for s in engine.stats.steps]
    assert max(sizes) == 10 and stepped.tokens == 2 * sum(2 + 3 * i for i in range(10))
    restarts = [i for i in range(1, len(sizes)) if sizes[i] > sizes[i - 1]]
    assert len(restarts) == 1  # the second step starts at full batch again, once
    assert stepped.tail_seconds > 0  # each step's longest response decodes alone after the other nine ended

    served = run_engine(engine, FixedController(None), prompts, params)
    assert max(s.batch_size for s in engine.stats.steps) == 12
    assert served.lengths == stepped.lengths  # same seeds, same texts: only the shape differs


def test_ratio_interval_covers_the_true_ratio_at_its_level() -> None:
    # Six paired repeats with multiplicative noise of 12% (this machine's spread): the 90% interval of the
    # geometric mean holds the true ratio in about 90% of benchmarks, and a single ratio has no interval.
    import random

    from specrl.runtime.rl.significance import ratio_interval

    rng = random.Random(5)
    hits = 0
    for _ in range(2000):
        ci = ratio_interval([0.95 * math.exp(rng.gauss(0, 0.12)) for _ in range(6)])
        assert ci is not None and ci["low"] < ci["geomean"] < ci["high"]
        hits += ci["low"] <= 0.95 <= ci["high"]
    assert 0.87 < hits / 2000 < 0.93
    exact = ratio_interval([1.1, 1.1, 1.1])
    assert exact == {"geomean": 1.1, "low": 1.1, "high": 1.1, "level": 0.9}
    assert ratio_interval([1.2]) is None and ratio_interval([]) is None


def test_reading_the_policys_predictions_does_not_change_its_course() -> None:
    """The sweep reads the policy's table between its runs; reading it for real folds the records kept since and
    times the next recomputation, so it reads a copy: the policy then decides exactly as if nobody had looked."""
    import copy
    import pickle

    from specrl.runtime.bench.rollout import predicted_speeds
    from specrl.runtime.engine.adaptive import AdaptiveController, AdaptiveSettings, label

    from .test_adaptive import Machine, calibrated

    def machine() -> Machine:
        return Machine({"draft_model": 0.8, "ngram": 0.5}, {"draft_model": 0.08, "ngram": 0.0}, seed=3)

    def course(ctrl: AdaptiveController, m: Machine, batch: int, steps: int) -> list[str]:
        out = []
        for _ in range(steps):
            d = ctrl.decide(batch)
            ctrl.observe(d, m.step(d, batch))
            out.append(label(d))
        return out

    methods = ["draft_model", "ngram"]
    ctrl = AdaptiveController(methods, cost_model=calibrated(machine(), methods), settings=AdaptiveSettings())
    looked, m1 = ctrl, machine()
    course(looked, m1, 8, 37)
    untouched, m2 = copy.deepcopy(looked), copy.deepcopy(m1)
    predicted = predicted_speeds(looked, 2)  # a batch size it has no table for yet
    assert predicted["ar"] == 1.0 and {k.split(":")[0] for k in predicted} == {"ar", *methods}
    assert predicted == {label(d): round(s, 3) for s, d in copy.deepcopy(untouched).table(2).values()}
    assert pickle.dumps(looked) == pickle.dumps(untouched)  # its whole state, records and tables' timing included
    assert course(looked, m1, 8, 200) + course(looked, m1, 2, 100) == \
        course(untouched, m2, 8, 200) + course(untouched, m2, 2, 100)
