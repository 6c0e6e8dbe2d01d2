"""Build, cache and load the project's own Llama-architecture policies (nothing comes from a model hub).

`load_policy("builtin:tiny")` returns a trained policy, building it on first use: a `LlamaForCausalLM`
from a `LlamaConfig`, a short supervised warm-up on the synthetic task's worked solutions (or, for a
draft model, distillation from its teacher), saved as a Hugging Face folder (config.json,
model.safetensors, generation_config.json, tokenizer files) that vLLM could load unchanged.

Cache: `cache_dir()/models/<name>-<digest of recipe>`. A build writes a temporary sibling folder and
renames it into place (readers never see half a model); an exclusive `flock` on `<folder>.lock`
makes a second process wait for the first instead of training the same model twice.

    python -m specrl.runtime.models.bootstrap builtin:tiny builtin:tiny-draft [--force] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..cores import available_cores
from ..paths import cache_dir
from ..rl.task import SyntheticTask, prompt_token_ids
from ..rl.tokenizer import CharTokenizer
from .evaluate import evaluate_accuracy
from .recipes import BUILTIN_RECIPES, Recipe, resolve_recipe

if TYPE_CHECKING:
    from rich.progress import Progress
    from transformers import LlamaConfig, LlamaForCausalLM

BUILD_INFO = "build_info.json"
EVAL_SEED = 424242  # evaluation problems never overlap the training seed range

# progress(stage, done, total, message) — the CLI renders it with rich; tests pass None.
ProgressFn = Callable[[str, int, int, str], None]


class ModelNotFoundError(ValueError):
    """A model reference that is neither a builtin recipe nor a Hugging Face folder."""


# -- model construction ---------------------------------------------------------------------------------


def llama_config(recipe: Recipe, tokenizer: CharTokenizer) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads or recipe.num_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )


def new_model(recipe: Recipe, tokenizer: CharTokenizer, seed: int | None = None) -> LlamaForCausalLM:
    from transformers import LlamaForCausalLM

    torch.manual_seed(recipe.seed if seed is None else seed)
    model = LlamaForCausalLM(llama_config(recipe, tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_id
    model.generation_config.eos_token_id = tokenizer.eos_id
    model.generation_config.bos_token_id = tokenizer.bos_id
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- data -----------------------------------------------------------------------------------------------


@dataclass
class Example:
    ids: list[int]          # BOS + prompt + response (+ EOS)
    prompt_len: int         # tokens before the response
    teacher_logprobs: torch.Tensor | None = None  # [response_len, vocab] for distillation


def sft_examples(recipe: Recipe, tokenizer: CharTokenizer) -> list[Example]:
    task = SyntheticTask(recipe.train_size, recipe.difficulty_mix, seed=recipe.data_seed)
    out = []
    for p in task:
        prompt = prompt_token_ids(p, tokenizer)
        out.append(Example(prompt + tokenizer.encode(p.solution or "", add_eos=True), len(prompt)))
    return out


def length_bucketed_batches(examples: Sequence[Example], batch_tokens: int, seed: int) -> Iterator[list[Example]]:
    """Endless batches of similar-length examples, at most `batch_tokens` padded tokens each.

    Sorting within shuffled pools keeps padding small although lengths are long-tailed.
    """
    rng = random.Random(seed)
    order = list(range(len(examples)))
    while True:
        rng.shuffle(order)
        batches: list[list[Example]] = []
        pool_size = 2048
        for start in range(0, len(order), pool_size):
            pool = sorted((examples[i] for i in order[start:start + pool_size]), key=lambda e: len(e.ids))
            batch: list[Example] = []
            width = 0
            for ex in pool:
                w = max(width, len(ex.ids))
                if batch and w * (len(batch) + 1) > batch_tokens:
                    batches.append(batch)
                    batch, w = [], len(ex.ids)
                batch.append(ex)
                width = w
            if batch:
                batches.append(batch)
        rng.shuffle(batches)
        yield from batches


def collate(batch: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask, and a mask of the positions whose next token is a response token."""
    width = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    target_mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for i, e in enumerate(batch):
        n = len(e.ids)
        ids[i, :n] = torch.tensor(e.ids)
        attn[i, :n] = 1
        target_mask[i, e.prompt_len - 1 : n - 1] = True  # position t predicts token t+1
    return ids, attn, target_mask


def fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX or AVX512-BF16): then autocast trains ~2.5x faster."""
    if torch.cuda.is_available():
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


# -- training -------------------------------------------------------------------------------------------


def _lr_at(step: int, recipe: Recipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * cosine)


def train(model: LlamaForCausalLM, recipe: Recipe, examples: Sequence[Example], tokenizer: CharTokenizer,
          progress: ProgressFn | None = None, stage: str = "train") -> list[float]:
    """SFT (cross-entropy on response tokens) or, when examples carry teacher log-probs, forward-KL distillation."""
    distill = examples[0].teacher_logprobs is not None
    use_bf16 = recipe.bf16_autocast and fast_bf16()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.98))
    batches = length_bucketed_batches(examples, recipe.batch_tokens, recipe.seed)
    model.train()
    losses: list[float] = []
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, recipe)
        batch = next(batches)
        ids, attn, target_mask = collate(batch, tokenizer.pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(input_ids=ids, attention_mask=attn).logits
        if distill:
            loss = _kl_loss(logits, batch, target_mask)
        else:
            targets = ids[:, 1:]
            sel = target_mask[:, :-1]
            loss = F.cross_entropy(logits[:, :-1][sel].float(), targets[sel])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(stage, step + 1, recipe.steps, f"loss {losses[-1]:.3f}")
    model.eval()
    return losses


def _kl_loss(logits: torch.Tensor, batch: Sequence[Example], target_mask: torch.Tensor) -> torch.Tensor:
    """Mean over response positions of KL(teacher || student) on the full next-token distribution."""
    student = F.log_softmax(logits[target_mask].float(), dim=-1)
    rows = [e.teacher_logprobs for e in batch if e.teacher_logprobs is not None]
    if len(rows) != len(batch):
        raise ValueError("distillation: every example needs teacher log-probs, some have none")
    teacher = torch.cat(rows, dim=0)  # same row order as the mask
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


@torch.no_grad()
def teacher_samples(teacher: Any, recipe: Recipe, tokenizer: CharTokenizer,
                    progress: ProgressFn | None = None, batch_size: int = 64) -> list[Example]:
    """Responses sampled from the teacher at temperature 1 with its log-probs at every response position."""
    task = SyntheticTask(recipe.teacher_samples, recipe.difficulty_mix, seed=recipe.data_seed)
    prompts = [prompt_token_ids(p, tokenizer) for p in task]
    # similar prompt lengths together: less left padding
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    gen = torch.Generator().manual_seed(recipe.seed + 17)
    out: list[Example] = []
    teacher.eval()
    for start in range(0, len(order), batch_size):
        chunk = [prompts[i] for i in order[start:start + batch_size]]
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        ids, attn = left_pad(chunk, tokenizer.pad_id)
        res = teacher.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=recipe.teacher_max_new_tokens, output_logits=True, return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_id, eos_token_id=tokenizer.eos_id,
        )
        new_tokens = res.sequences[:, ids.shape[1]:]
        logprobs = F.log_softmax(torch.stack(res.logits, dim=1).float(), dim=-1)
        for row, prompt in enumerate(chunk):
            toks = new_tokens[row].tolist()
            n = toks.index(tokenizer.eos_id) + 1 if tokenizer.eos_id in toks else len(toks)
            out.append(Example(prompt + toks[:n], len(prompt), logprobs[row, :n].clone()))
        if progress is not None:
            progress("teacher samples", min(start + batch_size, len(order)), len(order), "")
    return out


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(list(s))
        attn[i, width - len(s):] = 1
    return ids, attn


# symmetry breaking between a grown model's copies: small next to the weights, so it starts as good as its base
GROW_NOISE = 0.01


# -- cache ----------------------------------------------------------------------------------------------


def _teacher_recipe(recipe: Recipe) -> Recipe | None:
    if recipe.teacher is None:
        return None
    return recipe.teacher if isinstance(recipe.teacher, Recipe) else resolve_recipe(recipe.teacher)


def _base_recipe(recipe: Recipe) -> Recipe | None:
    return resolve_recipe(recipe.grow_from) if recipe.grow_from is not None else None


def recipe_digest(recipe: Recipe) -> str:
    teacher, base = _teacher_recipe(recipe), _base_recipe(recipe)
    return recipe.digest(recipe_digest(teacher) if teacher is not None else None,
                         recipe_digest(base) if base is not None else None)


@torch.no_grad()
def grow(base: LlamaForCausalLM, grown: LlamaForCausalLM, noise: float = 0.0, seed: int = 0) -> None:
    """Initialise `grown` from `base` so that it computes what `base` computes, at `grown`'s size.

    Width (HyperCloning, Samragh et al. 2024): every hidden, head and MLP vector is `base`'s repeated w times and
    each weight matrix is `base`'s tiled w x w and divided by w, so the activations are w copies of `base`'s
    (RMSNorm of a repeated vector is the repeated norm; heads keep their dimension, so attention is unchanged).
    Depth (block expansion, LLaMA-Pro): each widened base layer is followed by copies of it whose output projections
    (o_proj, down_proj) are zero, a residual identity. `noise` (relative to each matrix's std) breaks the symmetry
    between the copies, which would otherwise get identical gradients for ever.
    """
    bc, gc = base.config, grown.config
    w = gc.hidden_size // bc.hidden_size
    if (gc.hidden_size != w * bc.hidden_size or gc.intermediate_size != w * bc.intermediate_size
            or gc.num_attention_heads != w * bc.num_attention_heads
            or (gc.num_key_value_heads or gc.num_attention_heads)
            != w * (bc.num_key_value_heads or bc.num_attention_heads) or gc.vocab_size != bc.vocab_size):
        raise ValueError("grow: the grown model's hidden, intermediate and head counts must be the same multiple "
                         "of the base's (head dimension unchanged)")
    src, dst = base.model.layers, grown.model.layers
    if len(dst) % len(src):
        raise ValueError(f"grow: {len(dst)} layers is not a multiple of the base's {len(src)}")
    per = len(dst) // len(src)
    gen = torch.Generator().manual_seed(seed)

    def tile(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        out = t.repeat(rows, cols) / cols  # columns split the input copies: divide so the sum is base's
        if noise and t.ndim == 2:
            out += torch.randn(out.shape, generator=gen) * noise * float(t.std())
        return out

    grown.model.embed_tokens.weight.copy_(base.model.embed_tokens.weight.repeat(1, w))
    grown.model.norm.weight.copy_(base.model.norm.weight.repeat(w))
    grown.lm_head.weight.copy_(tile(base.lm_head.weight, 1, w))
    for i, layer in enumerate(dst):
        b = src[i // per]
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            layer.get_submodule(name).weight.copy_(tile(b.get_submodule(name).weight, w, w))
        layer.input_layernorm.weight.copy_(b.input_layernorm.weight.repeat(w))
        layer.post_attention_layernorm.weight.copy_(b.post_attention_layernorm.weight.repeat(w))
        if i % per:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def model_dir(recipe: Recipe, root: Path | None = None) -> Path:
    base = root if root is not None else cache_dir("models")
    return base / f"{recipe.name}-{recipe_digest(recipe)}"


def is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in ("config.json", "model.safetensors", "specrl_tokenizer.json", BUILD_INFO))


@contextlib.contextmanager
def exclusive(lock_path: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# Below this width a layer's matmuls are too small to split across cores: a second intra-op thread adds only
# synchronisation, and on a busy machine its spin-waits cost 10x or more (measured on this 2-core machine at load
# average 5-6, the tiny recipe's training step, interleaved: 1 thread 0.29-0.56 s wall / 0.1 CPU-s, 2 threads
# 3.6-6.0 s wall / 1.3-2.6 CPU-s). At 256 wide (builtin:small) two threads are ~1.6x faster on a quiet machine
# (148 vs 241 ms a step), but at load average ~6 a two-thread build ran 7 minutes without finishing 400 steps.
PARALLEL_MIN_HIDDEN = 512


def build_threads(recipe: Recipe, available: int | None) -> int:
    """Torch threads to build `recipe` with: one for narrow models, `available` (None: every core this process may
    use) otherwise. Not torch's current setting: a caller that measures on one thread (`specrl bench rollout`) set
    it to 1 before loading its models, and its first use built the bench policy on one thread: 2029 s on a 2-core
    AVX2-only EPYC, one core idle."""
    if recipe.hidden_size < PARALLEL_MIN_HIDDEN:
        return 1
    return available if available is not None else available_cores()


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ensure_built(recipe: Recipe, *, root: Path | None = None, force: bool = False, threads: int | None = None,
                 progress: ProgressFn | None = None, evaluate: bool = True) -> Path:
    """The folder of `recipe`'s trained model, building it (and its teacher) first when it is not cached."""
    final = model_dir(recipe, root)
    if is_complete(final) and not force:
        return final
    teacher = _teacher_recipe(recipe) or _base_recipe(recipe)  # a grown model's base is built first, like a teacher
    teacher_dir = ensure_built(teacher, root=root, threads=threads, progress=progress, evaluate=evaluate) \
        if teacher is not None else None

    with _threads(build_threads(recipe, threads)):
        return build_atomically(final, lambda tmp: _build_into(tmp, recipe, teacher_dir, progress, evaluate),
                                lambda d: is_complete(d) and not force, verb="building")


def build_atomically(final: Path, fill: Callable[[Path], None], done: Callable[[Path], bool], *, verb: str) -> Path:
    """Fill `final` once per machine: under an exclusive lock, `fill` writes a temporary sibling folder that is
    then renamed into place, so readers never see half a folder and a second process waits for the first."""

    def waiting() -> None:
        print(f"waiting for another process that is {verb} {final.name} ...", file=sys.stderr)

    with exclusive(final.parent / f"{final.name}.lock", waiting):
        if done(final):  # filled by the process we waited for
            return final
        # holding the lock, any temp folder of this name is debris of a fill that was killed
        for debris in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(debris, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            fill(tmp)
            if final.exists():  # --force, or debris of an incomplete old fill
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build_into(out: Path, recipe: Recipe, teacher_dir: Path | None, progress: ProgressFn | None,
                evaluate: bool) -> None:
    tokenizer = CharTokenizer()
    t0 = time.perf_counter()
    cpu0 = time.process_time()  # CPU seconds tell the cost apart from contention on a shared machine
    info: dict = {"name": recipe.name, "digest": recipe_digest(recipe), "recipe": recipe.identity(),
                  "description": recipe.description, "threads": torch.get_num_threads(),
                  "torch": torch.__version__}
    if teacher_dir is not None and recipe.grow_from is None:
        teacher, _ = load_model_dir(teacher_dir)
        t_sample = time.perf_counter()
        examples = teacher_samples(teacher, recipe, tokenizer, progress)
        info["teacher"] = teacher_dir.name
        info["teacher_sample_seconds"] = round(time.perf_counter() - t_sample, 2)
        info["teacher_sample_tokens"] = sum(len(e.ids) - e.prompt_len for e in examples)
        del teacher
    else:
        examples = sft_examples(recipe, tokenizer)
    model = new_model(recipe, tokenizer)
    if teacher_dir is not None and recipe.grow_from is not None:
        base, _ = load_model_dir(teacher_dir)
        grow(base, model, noise=GROW_NOISE, seed=recipe.seed)
        info["grown_from"] = teacher_dir.name
        del base
    t_train = time.perf_counter()
    losses = train(model, recipe, examples, tokenizer, progress, stage=f"train {recipe.name}")
    info["precision"] = "bf16 autocast" if recipe.bf16_autocast and fast_bf16() else "fp32"
    info["train_seconds"] = round(time.perf_counter() - t_train, 2)
    info["build_seconds"] = round(time.perf_counter() - t0, 2)
    info["build_cpu_seconds"] = round(time.process_time() - cpu0, 2)
    info["parameters"] = count_parameters(model)
    info["trained_steps"] = recipe.steps
    info["loss_first"] = round(sum(losses[:10]) / min(10, len(losses)), 4)
    info["loss_last"] = round(sum(losses[-10:]) / min(10, len(losses)), 4)
    info["losses"] = [round(x, 4) for x in losses]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if evaluate and recipe.eval_size > 0:
        t_eval = time.perf_counter()
        problems = list(SyntheticTask(recipe.eval_size, recipe.difficulty_mix, seed=EVAL_SEED))
        info["eval"] = {
            "problems": len(problems),
            "greedy": evaluate_accuracy(model, tokenizer, problems, temperature=0.0, progress=progress),
            "temperature_1": evaluate_accuracy(model, tokenizer, problems, temperature=1.0, seed=1,
                                               progress=progress),
        }
        info["eval_seconds"] = round(time.perf_counter() - t_eval, 2)
    # written last: its presence marks the folder complete
    (out / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")


# -- loading --------------------------------------------------------------------------------------------


def load_model_dir(path: str | Path,
                   dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, CharTokenizer]:
    from transformers import LlamaForCausalLM

    path = Path(path)
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model, CharTokenizer.from_pretrained(path)


def resolve_model_path(name_or_path: str | Path, *, build: bool = True, threads: int | None = None,
                       progress: ProgressFn | None = None) -> Path:
    """`builtin:<name>` -> its cache folder (built when missing and `build`); a folder path -> itself."""
    ref = str(name_or_path)
    if ref.startswith("builtin:"):
        recipe = resolve_recipe(ref)
        path = model_dir(recipe)
        if not is_complete(path):
            if not build:
                raise ModelNotFoundError(f"model: {ref} is not built yet (python -m "
                                         f"specrl.runtime.models.bootstrap {ref})")
            path = ensure_built(recipe, threads=threads, progress=progress)
        return path
    path = Path(ref).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"model: {ref!r} is neither a builtin ({', '.join('builtin:' + k for k in BUILTIN_RECIPES)}) "
            "nor a Hugging Face model folder with a config.json")
    return path


def load_policy(name_or_path: str | Path, dtype: torch.dtype | str = torch.float32, *, threads: int | None = None,
                progress: ProgressFn | None = None, device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) for any model name (`specrl.runtime.models.hub`); toy builtins are built on first use."""
    from .hub import load_causal_lm, load_tokenizer

    if str(name_or_path).removeprefix("builtin:") in BUILTIN_RECIPES and str(name_or_path).startswith("builtin:"):
        resolve_model_path(name_or_path, threads=threads, progress=progress)  # build with these threads/progress
    return load_causal_lm(name_or_path, dtype, device), load_tokenizer(name_or_path)


def build_info(name_or_path: str | Path) -> dict:
    """The build record (parameters, trained steps, losses, evaluation) of a built model folder."""
    path = resolve_model_path(name_or_path, build=False)
    f = path / BUILD_INFO
    return json.loads(f.read_text()) if f.is_file() else {}


def ensure_models(names: Sequence[str], *, threads: int | None = None, force: bool = False,
                  progress: ProgressFn | None = None) -> dict[str, Path]:
    """Build the toy builtins among `names` and convert the packaged checkpoints (builtin:smollm2-135m)."""
    from .hub import PACKAGED, resolve_model

    return {n: resolve_model(n) if n.removeprefix("builtin:") in PACKAGED
            else ensure_built(resolve_recipe(n), threads=threads, force=force, progress=progress) for n in names}


# -- CLI ------------------------------------------------------------------------------------------------


def _rich_progress() -> tuple[Progress, ProgressFn]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[note]}"), TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
    tasks: dict[str, TaskID] = {}

    def update(stage: str, done: int, total: int, note: str) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total, note=note)
        bar.update(tasks[stage], completed=done, total=total, note=note)

    return bar, update


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specrl.runtime.models.bootstrap",
                                     description="Build the project's builtin policies into the cache.")
    parser.add_argument("models", nargs="*", default=["builtin:tiny", "builtin:tiny-draft"],
                        help="builtin:tiny, builtin:tiny-draft, builtin:small, builtin:bench, builtin:bench-draft "
                             "(default: the tiny pair)")
    parser.add_argument("--force", action="store_true", help="rebuild even when cached")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads")
    parser.add_argument("--list", action="store_true", help="list builtins and their cache folders")
    args = parser.parse_args(argv)
    if args.list:
        for name, r in BUILTIN_RECIPES.items():
            path = model_dir(r)
            state = "built" if is_complete(path) else "not built"
            print(f"builtin:{name:<12} ~{r.approx_parameters() / 1e6:5.1f}M  {state:<9}  {path}")
        return 0
    try:
        recipes = [resolve_recipe(n) for n in args.models]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bar, update = _rich_progress()
    with bar:
        paths = {r.name: ensure_built(r, force=args.force, threads=args.threads, progress=update) for r in recipes}
    for name, path in paths.items():
        info = json.loads((path / BUILD_INFO).read_text())
        ev = info.get("eval", {})
        acc = (f"  accuracy greedy {ev['greedy']['accuracy']:.2f}, T=1 {ev['temperature_1']['accuracy']:.2f}"
               if ev else "")
        print(f"builtin:{name}: {info['parameters'] / 1e6:.2f}M params, built in {info['build_seconds']:.0f}s"
              f"{acc}\n  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
