"""Verifiable reasoning tasks: the builtin synthetic arithmetic task and a JSONL loader for real datasets.

The builtin task is multi-step integer arithmetic with a worked solution, e.g.::

    prompt   "Q:7+5*3-2=?"
    solution "7+15-2;22-2;20;A:20"

Each step rewrites the whole remaining expression after one reduction (first a product, else the
leftmost sum/difference). Rewriting instead of naming the single operation keeps every step a local
copy-plus-one-fact edit a small model can learn, and it makes response length grow roughly with the
square of the number of operations: with a mix of mostly easy and a few hard problems the response
lengths have the long tail RL rollouts have (most sequences finish early, a few run long).
Products are always digit × digit (two `*` never touch), sums may involve larger numbers.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from .tokenizer import CharTokenizer, HFTokenizer

log = logging.getLogger(__name__)

# difficulty -> inclusive range of the number of operations
DIFFICULTY_OPS: dict[str, tuple[int, int]] = {"easy": (1, 2), "medium": (3, 5), "hard": (6, 10)}
DEFAULT_MIX: dict[str, float] = {"easy": 0.6, "medium": 0.3, "hard": 0.1}
BUILTIN_TASK = "builtin:arithmetic"

STEP_SEP = ";"
ANSWER_MARK = "A:"


@dataclass(frozen=True)
class Problem:
    """One prompt with its verifiable answer; `solution` is a worked response when one is known."""

    id: str
    prompt: str
    answer: str
    solution: str | None = None
    difficulty: str | None = None


# -- the synthetic task ---------------------------------------------------------------------------------


def _validate_mix(difficulty: Mapping[str, float] | None) -> dict[str, float]:
    mix = dict(DEFAULT_MIX if difficulty is None else difficulty)
    if not mix:
        raise ValueError("difficulty: empty mix; give weights for some of " + ", ".join(DIFFICULTY_OPS))
    for name, weight in mix.items():
        if name not in DIFFICULTY_OPS:
            raise ValueError(f"difficulty.{name}: unknown level; expected one of {', '.join(DIFFICULTY_OPS)}")
        if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"difficulty.{name}: weight must be a finite number >= 0, got {weight!r}")
    if sum(mix.values()) <= 0:
        raise ValueError("difficulty: weights sum to 0")
    return mix


def _random_expression(rng: random.Random, n_ops: int) -> list[int | str]:
    """Alternating numbers and operators; a `*` never follows a `*`, so products are digit × digit."""
    expr: list[int | str] = [rng.randint(1, 9)]
    prev = ""
    for _ in range(n_ops):
        op = rng.choice("+-" if prev == "*" else "+-**")
        expr += [op, rng.randint(1, 9)]
        prev = op
    return expr


def _render(expr: Sequence[int | str]) -> str:
    return "".join(str(t) for t in expr)


def _reduce_once(expr: list[int | str]) -> list[int | str]:
    """Apply one reduction: the first product, else the leftmost + or -."""
    ops = expr[1::2]
    k = ops.index("*") if "*" in ops else 0
    i = 2 * k + 1
    a, op, b = expr[i - 1], expr[i], expr[i + 1]
    assert isinstance(a, int) and isinstance(b, int)
    value = a * b if op == "*" else a + b if op == "+" else a - b
    return [*expr[: i - 1], value, *expr[i + 2 :]]


def worked_solution(expression: str) -> tuple[str, str]:
    """(solution text, answer) for an expression of digits joined by + - * (as the task writes them)."""
    expr: list[int | str] = [int(t) if t.isdigit() else t for t in re.findall(r"\d+|[+\-*]", expression)]
    if _render(expr) != expression or len(expr) % 2 == 0:
        raise ValueError(f"expression {expression!r} is not digits joined by + - *")
    steps = []
    while len(expr) > 1:
        expr = _reduce_once(expr)
        steps.append(_render(expr))
    answer = str(expr[0])
    return STEP_SEP.join([*steps, f"{ANSWER_MARK}{answer}"]), answer


class SyntheticTask(Sequence[Problem]):
    """`size` arithmetic problems drawn deterministically from `seed` and a difficulty mix.

    Problem `i` depends only on (seed, i), so a larger task extends a smaller one with the same seed.
    """

    def __init__(self, size: int, difficulty: Mapping[str, float] | None = None, seed: int = 0,
                 style: str = "toy") -> None:
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"size: must be an integer >= 0, got {size!r}")
        if style not in PROMPT_STYLES:
            raise ValueError(f"style: must be one of {', '.join(PROMPT_STYLES)}, got {style!r}")
        self.size = size
        self.seed = seed
        self.style = style
        self.mix = _validate_mix(difficulty)
        self._levels = list(self.mix)
        self._weights = [self.mix[k] for k in self._levels]
        self.problems: list[Problem] = [self._make(i) for i in range(size)]

    def _make(self, i: int) -> Problem:
        rng = random.Random(f"specrl-arith:{self.seed}:{i}")
        level = rng.choices(self._levels, self._weights)[0]
        lo, hi = DIFFICULTY_OPS[level]
        expression = _render(_random_expression(rng, rng.randint(lo, hi)))
        solution, answer = worked_solution(expression)
        return Problem(id=f"arith-{self.seed}-{i}", prompt=format_prompt(expression, self.style), answer=answer,
                       solution=solution, difficulty=level)

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, i: int) -> Problem: ...
    @overload
    def __getitem__(self, i: slice) -> list[Problem]: ...
    def __getitem__(self, i: int | slice) -> Problem | list[Problem]:
        return self.problems[i]

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.problems)


# "toy": the compact form the builtin toy policies are trained on; "chat": a question a pretrained instruct
# model understands (it answers "The answer is 12." — see `extract_answer`).
PROMPT_STYLES = ("toy", "chat")


def format_prompt(expression: str, style: str = "toy") -> str:
    if style == "chat":
        return f"What is {expression}? Answer with just the number."
    return f"Q:{expression}=?"


def prompt_token_ids(problem: Problem, tokenizer: CharTokenizer | HFTokenizer) -> list[int]:
    """What the policy is conditioned on: BOS + prompt text for the toy models, the chat template (or the raw
    text, as the spec says) for real ones — the tokenizer knows which (`CharTokenizer`/`HFTokenizer`)."""
    return tokenizer.prompt_ids(problem.prompt)


# -- answers --------------------------------------------------------------------------------------------

_NUMBER = r"(-?[\d,]*\.?\d+)"
_ANSWER_RE = re.compile(r"A:\s*" + _NUMBER)
_GSM8K_RE = re.compile(r"####\s*\$?\s*" + _NUMBER)
_BOXED_RE = re.compile(r"\\boxed\{\s*\$?" + _NUMBER + r"\s*\}")
_ANSWER_IS_RE = re.compile(r"[Aa]nswer is:?\s*\$?\s*" + _NUMBER)
_ANY_NUMBER_RE = re.compile(_NUMBER)


def normalize_answer(text: str) -> str:
    """Canonical form of a numeric answer: no commas, `$`, spaces, leading `+` or trailing `.0`."""
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").lstrip("+")
    try:
        value = float(s)
    except ValueError:
        return s
    if math.isfinite(value) and value == int(value):
        return str(int(value))
    return s


def extract_answer(text: str, last_number: bool = False) -> str | None:
    """The final answer in a response: the last `A:<number>`, else GSM8K's `#### <number>`, else `\\boxed{<n>}`,
    else "the answer is <number>" (how instruct models state it).
    With `last_number`, a response without any of these marks answers with its last number ("5 + 1 = 6" -> 6):
    how a small instruct model replies to "Answer with just the number."
    """
    for pattern in (_ANSWER_RE, _GSM8K_RE, _BOXED_RE, _ANSWER_IS_RE) + ((_ANY_NUMBER_RE,) if last_number else ()):
        found = pattern.findall(text)
        if found:
            return normalize_answer(found[-1])
    return None


def is_correct(response: str, answer: str, last_number: bool = False) -> bool:
    predicted = extract_answer(response, last_number)
    return predicted is not None and predicted == normalize_answer(answer)


def response_lengths(problems: Sequence[Problem], tokenizer: CharTokenizer | None = None) -> list[int]:
    """Token lengths of the worked solutions (+1 for EOS): the reference response-length distribution."""
    tok = tokenizer or CharTokenizer()
    return [len(tok.encode(p.solution or "")) + 1 for p in problems]


# -- JSONL datasets -------------------------------------------------------------------------------------


class DatasetError(ValueError):
    """A dataset file that cannot be used at all (missing, empty, nothing valid in it)."""


class JsonlRecord(BaseModel):
    """One line of a JSONL dataset: `prompt` (or GSM8K's `question`) and `answer`.

    `answer` is either the bare final answer or a GSM8K-style worked answer ending in `#### <number>`.
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True, coerce_numbers_to_str=True)

    prompt: str
    answer: str
    id: str | None = None

    @field_validator("prompt", "answer")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v


@dataclass
class JsonlDataset:
    """Problems loaded from a JSONL file and how many lines were skipped as malformed."""

    path: Path
    problems: list[Problem]
    malformed: int

    def __len__(self) -> int:
        return len(self.problems)


def _parse_line(line: str, lineno: int, prompt_field: str = "prompt", answer_field: str = "answer") -> Problem:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError("line is not a JSON object")  # noqa: TRY004 - reported as a malformed line
    if prompt_field == "prompt" and "prompt" not in obj and "question" in obj:
        prompt_field = "question"  # GSM8K's own files name the prompt `question`
    # Missing configured fields are named as the user spelled them (spec.dataset.promptField/answerField).
    for key in (prompt_field, answer_field):
        if key not in obj:
            raise ValueError(f"{key}: field required")
    rec = JsonlRecord.model_validate({"prompt": obj[prompt_field], "answer": obj[answer_field],
                                      **({"id": obj["id"]} if "id" in obj else {})})
    answer_text = rec.answer
    if "####" in answer_text:
        final = extract_answer(answer_text)
        if final is None:
            raise ValueError("answer: `####` is not followed by a number")
        solution: str | None = answer_text
    else:
        final, solution = normalize_answer(answer_text), None
    return Problem(id=rec.id or f"line-{lineno}", prompt=rec.prompt, answer=final, solution=solution)


def load_jsonl(path: str | Path, *, strict: bool = False, prompt_field: str = "prompt",
               answer_field: str = "answer") -> JsonlDataset:
    """Load a JSONL dataset whose lines hold the prompt under `prompt_field` and the answer under `answer_field`.

    The defaults read `prompt` (or GSM8K's `question`) and `answer`; the job spec sets other keys with
    `spec.dataset.promptField` / `answerField`.

    Malformed lines (not JSON, not an object, missing/empty fields, a `####` answer without a number)
    are skipped with a warning and counted in `JsonlDataset.malformed`: real dataset dumps often hold
    a few broken records and one of them should not kill a long job, while the count keeps the loss
    visible. `strict=True` fails on the first one instead. A missing file, or a file with no valid
    line at all, always raises `DatasetError` naming the file.
    """
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file {str(p)!r} does not exist" if not p.exists()
                           else f"dataset path {str(p)!r} is a directory" if p.is_dir()
                           else f"dataset path {str(p)!r} is not a file")
    problems: list[Problem] = []
    malformed = 0
    with p.open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                problems.append(_parse_line(line, lineno, prompt_field, answer_field))
            except (json.JSONDecodeError, ValidationError, ValueError) as exc:
                reason = _short_reason(exc)
                if strict:
                    raise DatasetError(f"{p}:{lineno}: malformed line: {reason}") from None
                malformed += 1
                if malformed <= 5:
                    log.warning("%s:%d: skipping malformed line: %s", p, lineno, reason)
    if malformed:
        log.warning("%s: skipped %d malformed line(s), kept %d", p, malformed, len(problems))
    if not problems:
        raise DatasetError(f"dataset file {str(p)!r} has no valid lines ({malformed} malformed)")
    return JsonlDataset(path=p, problems=problems, malformed=malformed)


def _short_reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "line"
        return f"{field}: {err['msg']}"
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON ({exc.msg})"
    return str(exc)


def load_problems(source: str, *, size: int = 1000, difficulty: Mapping[str, float] | None = None,
                  seed: int = 0, prompt_field: str = "prompt", answer_field: str = "answer") -> list[Problem]:
    """Problems from `builtin:arithmetic` (generated) or a path to a JSONL file."""
    if source in (BUILTIN_TASK, "builtin", "arithmetic"):
        return list(SyntheticTask(size, difficulty, seed))
    return load_jsonl(source, prompt_field=prompt_field, answer_field=answer_field).problems
