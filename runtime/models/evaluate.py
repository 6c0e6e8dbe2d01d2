"""Task accuracy of a policy with plain Hugging Face `generate` (independent of the rollout engine)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..rl.task import Problem, is_correct, prompt_token_ids
from ..rl.tokenizer import CharTokenizer

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


@torch.no_grad()
def generate_responses(model: Any, tokenizer: CharTokenizer, problems: Sequence[Problem], *, temperature: float,
                       seed: int = 0, batch_size: int = 50, max_new_tokens: int = 192,
                       progress: Callable[[str, int, int, str], None] | None = None) -> list[list[int]]:
    """Response token ids (through the first EOS) for each problem; greedy when temperature is 0."""
    prompts = [prompt_token_ids(p, tokenizer) for p in problems]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    stage = f"eval T={temperature:g}"
    model.eval()
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        chunk = [prompts[i] for i in idx]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, s in enumerate(chunk):
            ids[r, width - len(s):] = torch.tensor(s)
            attn[r, width - len(s):] = 1
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
            else {"do_sample": False}
        torch.manual_seed(seed * 1_000_003 + start)
        seqs = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                              pad_token_id=tokenizer.pad_id, eos_token_id=tokenizer.eos_id, **sampling)
        for r, i in enumerate(idx):
            toks = seqs[r, width:].tolist()
            out[i] = toks[: toks.index(tokenizer.eos_id) + 1] if tokenizer.eos_id in toks else toks
        if progress is not None:
            progress(stage, min(start + batch_size, len(order)), len(order), "")
    return out


def evaluate_accuracy(model: LlamaForCausalLM, tokenizer: CharTokenizer, problems: Sequence[Problem], *, temperature: float,
                      seed: int = 0, batch_size: int = 50, max_new_tokens: int = 192,
                      progress: Callable[[str, int, int, str], None] | None = None) -> dict:
    """Exact-match accuracy overall and per difficulty, plus response-length statistics."""
    responses = generate_responses(model, tokenizer, problems, temperature=temperature, seed=seed,
                                   batch_size=batch_size, max_new_tokens=max_new_tokens, progress=progress)
    hits: dict[str, list[bool]] = defaultdict(list)
    lengths = []
    correct = 0
    for p, toks in zip(problems, responses):
        ok = is_correct(tokenizer.decode(toks), p.answer)
        correct += ok
        hits[p.difficulty or "all"].append(ok)
        lengths.append(len(toks))
    lengths.sort()
    n = max(1, len(problems))
    return {
        "accuracy": round(correct / n, 4),
        "by_difficulty": {k: round(sum(v) / len(v), 4) for k, v in sorted(hits.items())},
        "mean_response_tokens": round(sum(lengths) / n, 2),
        "p50_response_tokens": lengths[len(lengths) // 2] if lengths else 0,
        "p90_response_tokens": lengths[int(len(lengths) * 0.9)] if lengths else 0,
    }


@torch.no_grad()
def expected_acceptance(target: LlamaForCausalLM, draft: LlamaForCausalLM, tokenizer: CharTokenizer, problems: Sequence[Problem], *,
                        temperature: float = 1.0, seed: int = 0, batch_size: int = 50,
                        max_new_tokens: int = 192) -> dict:
    """Per-token acceptance probability of speculative sampling, α = E[Σ_v min(p_v, q_v)], and α under greedy
    (argmax agreement), along the target's own samples: how well `draft` predicts `target` on rollouts.
    """
    responses = generate_responses(target, tokenizer, problems, temperature=temperature, seed=seed,
                                   batch_size=batch_size, max_new_tokens=max_new_tokens)
    total_min = total_argmax = 0.0
    count = 0
    for start in range(0, len(problems), batch_size):
        seqs = [prompt_token_ids(p, tokenizer) + r for p, r in
                zip(problems[start:start + batch_size], responses[start:start + batch_size])]
        plens = [len(prompt_token_ids(p, tokenizer)) for p in problems[start:start + batch_size]]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tokenizer.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for r, (s, pl) in enumerate(zip(seqs, plens)):
            ids[r, :len(s)] = torch.tensor(s)
            attn[r, :len(s)] = 1
            mask[r, pl - 1:len(s) - 1] = True
        t = target(input_ids=ids, attention_mask=attn).logits[mask].float()
        d = draft(input_ids=ids, attention_mask=attn).logits[mask].float()
        temp = temperature if temperature > 0 else 1.0
        p, q = torch.softmax(t / temp, -1), torch.softmax(d / temp, -1)
        total_min += float(torch.minimum(p, q).sum())
        total_argmax += float((t.argmax(-1) == d.argmax(-1)).sum())
        count += int(mask.sum())
    return {"alpha": round(total_min / max(1, count), 4), "greedy_alpha": round(total_argmax / max(1, count), 4),
            "positions": count}
