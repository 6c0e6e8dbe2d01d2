"""Micro versions of the bootstrap recipes: build, cache, lock, load — seconds, not minutes."""

import json
import os
import threading

import pytest
import torch
from specrl.runtime.models import bootstrap
from specrl.runtime.models.bootstrap import (
    ModelNotFoundError,
    ensure_built,
    is_complete,
    load_policy,
    model_dir,
    resolve_model_path,
)
from specrl.runtime.models.recipes import Recipe, resolve_recipe
from specrl.runtime.rl.tokenizer import CharTokenizer

MICRO = Recipe(name="micro", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
               difficulty=(("easy", 1.0),), train_size=300, steps=40, batch_tokens=512, lr=1e-2,
               warmup_steps=5, eval_size=8)
MICRO_DRAFT = Recipe(name="micro-draft", hidden_size=16, intermediate_size=32, num_layers=1, num_heads=1,
                     difficulty=(("easy", 1.0),), steps=25, batch_tokens=512, lr=1e-2, warmup_steps=5,
                     teacher=MICRO, teacher_samples=48, teacher_max_new_tokens=24, eval_size=0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def micro(root):
    torch.set_num_threads(1)
    return ensure_built(MICRO, root=root)


def test_micro_build_is_a_complete_hf_folder(micro):
    from transformers import AutoConfig, AutoTokenizer

    assert micro.name.startswith("micro-") and is_complete(micro)
    names = {p.name for p in micro.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "build_info.json"} <= names
    config = AutoConfig.from_pretrained(micro)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert config.vocab_size == CharTokenizer().vocab_size and config.eos_token_id == CharTokenizer.eos_id
    assert AutoTokenizer.from_pretrained(micro).encode("Q:1+2=?", add_special_tokens=False) == \
        CharTokenizer().encode("Q:1+2=?")
    info = json.loads((micro / "build_info.json").read_text())
    assert info["trained_steps"] == 40 and len(info["losses"]) == 40
    assert info["loss_last"] < 0.7 * info["loss_first"]  # the warm-up learns
    assert 0.0 <= info["eval"]["greedy"]["accuracy"] <= 1.0 and info["eval"]["problems"] == 8


def test_load_policy_from_folder_and_generate(micro):
    model, tok = load_policy(micro)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    ids = torch.tensor([tok.encode("Q:1+2=?", add_bos=True)])
    out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_id)
    assert out.shape == (1, ids.shape[1] + 5) or tok.eos_id in out[0].tolist()
    half, _ = load_policy(micro, dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16


def test_narrow_models_build_on_one_thread(micro, monkeypatch):
    # their matmuls are too small to split; a second thread only spins (10x slower wall time on a busy machine)
    assert bootstrap.build_threads(MICRO, 2) == 1 == bootstrap.build_threads(resolve_recipe("tiny"), None)
    assert bootstrap.build_threads(resolve_recipe("bench"), 2) == 2
    # wide ones on every core this process may use, not torch's current setting (a benchmark sets 1 before loading)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(torch.get_num_threads() + 1)))
    assert bootstrap.build_threads(resolve_recipe("bench"), None) == torch.get_num_threads() + 1
    assert json.loads((micro / bootstrap.BUILD_INFO).read_text())["threads"] == 1


def test_cache_is_reused_and_keyed_by_recipe(micro, root, monkeypatch):
    calls = []
    monkeypatch.setattr(bootstrap, "_build_into", lambda *a, **k: calls.append(a))
    assert ensure_built(MICRO, root=root) == micro and calls == []
    assert model_dir(MICRO.replace(steps=41), root) != micro
    assert model_dir(MICRO.replace(eval_size=3), root) == micro  # evaluation is not part of the identity


def test_distilled_draft_shares_the_tokenizer_and_learns(micro, root):
    path = ensure_built(MICRO_DRAFT, root=root)
    info = json.loads((path / "build_info.json").read_text())
    assert info["teacher"] == micro.name and info["teacher_sample_tokens"] > 0
    assert info["loss_last"] < info["loss_first"]
    draft, tok = load_policy(path)
    assert draft.config.vocab_size == tok.vocab_size
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in load_policy(micro)[0].parameters())
    # a new teacher means a new draft
    assert model_dir(MICRO_DRAFT.replace(teacher=MICRO.replace(steps=39)), root) != path


def test_concurrent_builders_train_once(tmp_path, monkeypatch):
    recipe = MICRO.replace(name="locked", steps=3, eval_size=0)
    real = bootstrap._build_into
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(bootstrap, "_build_into", counting)
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_built(recipe, root=tmp_path)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(calls) == 1 and len(set(results)) == 1 and is_complete(results[0])


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    recipe = MICRO.replace(name="broken", steps=2, eval_size=0)

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(bootstrap, "train", boom)
    killed = tmp_path / f".{model_dir(recipe, tmp_path).name}.tmp-killed"  # left by a SIGKILLed build
    killed.mkdir()
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_built(recipe, root=tmp_path)
    assert not model_dir(recipe, tmp_path).exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_bad_model_references(tmp_path):
    with pytest.raises(ValueError, match="unknown builtin 'builtin:huge'"):
        resolve_recipe("builtin:huge")
    with pytest.raises(ModelNotFoundError, match="neither a builtin"):
        resolve_model_path(tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="not divisible"):
        Recipe(name="x", hidden_size=30, intermediate_size=8, num_layers=1, num_heads=4)


def test_batched_left_padded_eval_matches_one_by_one(micro):
    from specrl.runtime.models.evaluate import evaluate_accuracy, generate_responses
    from specrl.runtime.rl.task import SyntheticTask

    model, tok = load_policy(micro)
    problems = list(SyntheticTask(6, {"easy": 1.0, "hard": 1.0}, seed=5))
    batched = generate_responses(model, tok, problems, temperature=0.0, batch_size=6, max_new_tokens=20)
    single = [generate_responses(model, tok, [p], temperature=0.0, batch_size=1, max_new_tokens=20)[0]
              for p in problems]
    assert batched == single
    stats = evaluate_accuracy(model, tok, problems, temperature=1.0, seed=3, max_new_tokens=20)
    assert set(stats["by_difficulty"]) <= {"easy", "hard"} and 0 <= stats["accuracy"] <= 1


def test_expected_acceptance_of_draft(micro, root):
    from specrl.runtime.models.evaluate import expected_acceptance
    from specrl.runtime.rl.task import SyntheticTask

    target, tok = load_policy(micro)
    draft, _ = load_policy(ensure_built(MICRO_DRAFT, root=root))
    problems = list(SyntheticTask(6, {"easy": 1.0}, seed=2))
    same = expected_acceptance(target, target, tok, problems, max_new_tokens=16)
    assert same["alpha"] == pytest.approx(1.0, abs=1e-4) and same["greedy_alpha"] == 1.0
    other = expected_acceptance(target, draft, tok, problems, max_new_tokens=16)
    assert 0.0 < other["alpha"] < 1.0 and other["positions"] == same["positions"] > 0


def test_grown_model_computes_what_its_base_computes():
    """Width x2 (HyperCloning) and depth x3 (zero-output copies): the same logits before any training; the
    symmetry-breaking noise moves them only a little; shapes that are not multiples are refused."""
    tok = CharTokenizer()
    base = bootstrap.new_model(MICRO.replace(num_layers=2), tok, seed=0).eval()
    grown = bootstrap.new_model(MICRO.replace(name="grown", hidden_size=64, intermediate_size=128, num_layers=6,
                                              num_heads=4), tok, seed=1).eval()
    ids = torch.tensor([tok.prompt_ids("Q:1+2*3-4=?")])
    bootstrap.grow(base, grown)
    torch.testing.assert_close(grown(ids).logits, base(ids).logits, atol=1e-4, rtol=1e-4)
    bootstrap.grow(base, grown, noise=0.01)
    gap = (grown(ids).logits - base(ids).logits).abs().max()
    assert 0 < gap < 0.05 * base(ids).logits.abs().max()
    odd = bootstrap.new_model(MICRO.replace(name="odd", hidden_size=48, num_heads=3, num_layers=2), tok)
    with pytest.raises(ValueError, match="multiple"):
        bootstrap.grow(base, odd)
