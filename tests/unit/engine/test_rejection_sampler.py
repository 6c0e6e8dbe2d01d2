"""Exact checks of the pure rejection sampler (no model, no sampling noise)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from specrl.runtime.engine.rejection_sampler import rejection_sample

V, K = 3, 2
ONE_MINUS = float(np.nextafter(1.0, 0.0))


def _table(seed: int, concentration: float = 1.0) -> dict[tuple[int, ...], np.ndarray]:
    """A random conditional next-token law for every context of length 0..K (float32-exact values)."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in range(K + 1):
        for ctx in itertools.product(range(V), repeat=n):
            p = rng.dirichlet([concentration] * V).astype(np.float32)
            if seed % 2 == 0 and n == 1:
                p[rng.integers(V)] = 0.0  # zero-probability tokens exercise the residual's clamp
            out[ctx] = (p / p.sum(dtype=np.float32)).astype(np.float32)
    return out


def _joint(law: dict, length: int) -> dict[tuple[int, ...], float]:
    res = {}
    for seq in itertools.product(range(V), repeat=length):
        pr = 1.0
        for i in range(length):
            pr *= float(law[seq[:i]][seq[i]])
        res[seq] = pr
    return res


def _call(target, draft, d: tuple[int, ...], pattern: tuple[bool, ...], deterministic: bool):
    """Run the sampler on draft d with uniforms that force `pattern` (accept/reject per position)."""
    tp = torch.tensor(np.stack([target[d[:i]] for i in range(K + 1)]))[None]
    dp = None if deterministic else torch.tensor(np.stack([draft[d[:i]] for i in range(K)]))[None]
    u = torch.tensor([[0.0 if a else ONE_MINUS for a in pattern]], dtype=torch.float64)
    return rejection_sample(tp, torch.tensor([d]), dp, u, torch.tensor([0.5], dtype=torch.float64))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_output_law_equals_target_law_exactly(seed: int, deterministic: bool) -> None:
    """Enumerate drafts and accept/reject patterns; the law of (emitted tokens, then exact target sampling up
    to K+1 tokens) must equal the target's joint law: TV < 1e-6."""
    target = _table(seed)
    draft = _table(seed + 100, concentration=0.5)
    law: dict[tuple[int, ...], float] = {}
    for d in itertools.product(range(V), repeat=K):
        if deterministic:
            p_draft = 1.0 if d == (0, 1) else 0.0  # a fixed deterministic guess
        else:
            p_draft = float(np.prod([draft[d[:i]][d[i]] for i in range(K)]))
        if p_draft == 0.0:
            continue
        for n_acc in range(K + 1):
            # Probability that exactly the first n_acc drafts are accepted.
            pr = p_draft
            for i in range(n_acc):
                q = 1.0 if deterministic else float(draft[d[:i]][d[i]])
                pr *= min(1.0, float(target[d[:i]][d[i]]) / q)
            if n_acc < K:
                q = 1.0 if deterministic else float(draft[d[:n_acc]][d[n_acc]])
                pr *= 1.0 - min(1.0, float(target[d[:n_acc]][d[n_acc]]) / q)
            if pr <= 0.0:
                continue
            pattern = tuple([True] * n_acc + [False] * (K - n_acc))
            res = _call(target, draft, d, pattern, deterministic)
            assert int(res.num_accepted[0]) == n_acc
            final = res.final_probs[0].double().numpy()
            for y in range(V):
                if final[y] == 0.0:
                    continue
                prefix = d[:n_acc] + (y,)
                # Continue with exact target sampling up to K+1 tokens.
                for rest in itertools.product(range(V), repeat=K - n_acc):
                    seq = prefix + rest
                    cont = 1.0
                    for i in range(len(prefix), K + 1):
                        cont *= float(target[seq[:i]][seq[i]])
                    law[seq] = law.get(seq, 0.0) + pr * final[y] * cont
    exact = _joint(target, K + 1)
    tv = 0.5 * sum(abs(law.get(s, 0.0) - exact[s]) for s in exact)
    assert abs(sum(law.values()) - 1.0) < 1e-6
    assert tv < 1e-6, tv


def test_acceptance_threshold_is_min_one_p_over_q() -> None:
    p = torch.tensor([[[0.2, 0.8], [0.5, 0.5]]])
    q = torch.tensor([[[0.5, 0.5]]])
    d = torch.tensor([[0]])  # p/q = 0.4
    for u, accepted in ((0.3999, 1), (0.4001, 0)):
        res = rejection_sample(p, d, q, torch.tensor([[u]], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64))
        assert int(res.num_accepted[0]) == accepted
    # On rejection the final token comes from norm(max(0, p - q)) = [0, 1].
    res = rejection_sample(p, d, q, torch.tensor([[0.9]], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64))
    assert res.final_probs[0].tolist() == [0.0, 1.0] and res.tokens[0].tolist() == [1, -1]


def test_greedy_target_accepts_exactly_the_argmax_prefix() -> None:
    # One-hot target (temperature 0): drafts equal to the argmax are accepted whatever the uniforms.
    p = torch.zeros(2, 4, 5)
    argmax = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0]])
    p.scatter_(2, argmax.unsqueeze(2), 1.0)
    drafts = torch.tensor([[1, 2, 0], [0, 4, 0]])
    q = torch.softmax(torch.randn(2, 3, 5), dim=-1)
    u = torch.full((2, 3), ONE_MINUS, dtype=torch.float64)
    res = rejection_sample(p, drafts, q, u, torch.tensor([ONE_MINUS, 0.0], dtype=torch.float64))
    assert res.num_accepted.tolist() == [2, 1]
    assert res.tokens.tolist() == [[1, 2, 3, -1], [0, 0, -1, -1]]


def test_ragged_draft_lengths() -> None:
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, 4, 6) * 3, dim=-1)
    drafts = torch.tensor([[1, 2, 3], [4, -1, -1], [-1, -1, -1]])
    lens = torch.tensor([3, 1, 0])
    u = torch.zeros(3, 3, dtype=torch.float64)  # accept everything that may be accepted
    res = rejection_sample(p, drafts, None, u, torch.full((3,), 0.5, dtype=torch.float64), lens)
    # A row never accepts beyond its own length; with no drafts the token comes from p_0 (a plain AR step).
    assert res.num_accepted.tolist()[1:] == [1 if float(p[1, 0, 4]) > 0 else 0, 0]
    assert torch.equal(res.final_probs[2], p[2, 0])
    assert (res.tokens >= -1).all() and (res.tokens[:, 0] >= 0).all()


@pytest.mark.parametrize("deterministic", [False, True])
def test_greedy_verify_equals_rejection_sampling_of_one_hot_targets(deterministic: bool) -> None:
    """The engine's greedy shortcut (argmax comparisons, no probabilities) emits exactly what the general sampler
    emits for the one-hot target `process_logits` builds at temperature 0, whatever the uniforms and drafter."""
    from specrl.runtime.engine.rejection_sampler import greedy_verify
    from specrl.runtime.engine.sampling import BatchSamplingTensors, SamplingParams, process_logits

    gen = torch.Generator().manual_seed(0)
    b, g, v = 64, 4, 7
    logits = torch.randn(b, g + 1, v, generator=gen).round()  # rounding makes ties: the lowest id must win
    st = BatchSamplingTensors.build([SamplingParams(temperature=0.0)] * b, torch.device("cpu")).expand(g + 1)
    p = process_logits(logits.view(-1, v), st).view(b, g + 1, v)
    best = logits.argmax(dim=-1)
    # drafts: the argmax for a random prefix, then random tokens (often wrong), ragged lengths with -1 padding
    keep = torch.randint(0, g + 1, (b, 1), generator=gen)
    drafts = torch.where(torch.arange(g) < keep, best[:, :g], torch.randint(0, v, (b, g), generator=gen))
    lens = torch.randint(0, g + 1, (b,), generator=gen)
    drafts = torch.where(torch.arange(g) < lens.unsqueeze(1), drafts, -1)
    q = None if deterministic else torch.softmax(torch.randn(b, g, v, generator=gen), dim=-1)
    u = torch.rand(b, g, generator=gen, dtype=torch.float64)
    res = rejection_sample(p, drafts, q, u, torch.rand(b, generator=gen, dtype=torch.float64), lens)
    tokens, num_accepted = greedy_verify(logits, drafts, lens)
    assert torch.equal(num_accepted, res.num_accepted)
    assert torch.equal(tokens, res.tokens)
    assert int(num_accepted.min()) == 0 and int(num_accepted.max()) == g  # both ends exercised


def test_unnormalised_rows_are_sampled_in_proportion() -> None:
    """A residual is sampled without dividing it by its mass: the uniform partitions [0, 1) into intervals of
    length w_i / sum(w), the same tokens the normalised row gives away from the interval edges."""
    from specrl.runtime.engine.sampling import sample_from_probs

    w = torch.tensor([[0.0, 0.3, 0.0, 0.1, 0.2]])  # mass 0.6: intervals [0, .5) -> 1, [.5, .667) -> 3, rest -> 4
    edges = [(0.0, 0.5, 1), (0.5, 2 / 3, 3), (2 / 3, 1.0, 4)]
    for lo, hi, token in edges:
        for x in torch.linspace(lo + 1e-6, hi - 1e-6, 50, dtype=torch.float64):
            assert int(sample_from_probs(w, x.view(1))[0]) == token
            assert int(sample_from_probs(w / w.sum(), x.view(1))[0]) == token
