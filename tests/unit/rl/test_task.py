import json
import logging
import os

import numpy as np
import pytest
from specrl.runtime.rl.task import (
    DatasetError,
    SyntheticTask,
    extract_answer,
    is_correct,
    load_jsonl,
    load_problems,
    normalize_answer,
    response_lengths,
    worked_solution,
)


def _eval(expr: str) -> int:
    assert set(expr) <= set("0123456789+-*")
    return eval(expr)


def test_deterministic_and_prefix_stable():
    a, b = SyntheticTask(200, seed=7), SyntheticTask(200, seed=7)
    assert a.problems == b.problems
    assert SyntheticTask(50, seed=7).problems == a.problems[:50]
    assert SyntheticTask(200, seed=8).problems != a.problems
    assert len({p.id for p in a}) == 200


def test_answers_and_worked_solutions_are_right():
    for p in SyntheticTask(500, seed=1):
        expr = p.prompt.removeprefix("Q:").removesuffix("=?")
        assert int(p.answer) == _eval(expr)
        assert p.solution is not None
        steps = p.solution.split(";")
        assert steps[-1] == f"A:{p.answer}"
        # every step is a valid rewrite with the same value, each one operation shorter
        values = [_eval(s) for s in steps[:-1]]
        assert all(v == int(p.answer) for v in values)
        n_ops = [sum(s[i] in "+-*" and i > 0 for i in range(len(s))) for s in [expr, *steps[:-1]]]
        assert n_ops == list(range(n_ops[0], -1, -1))
        assert is_correct(p.solution, p.answer)
    assert worked_solution("7+5*3-2") == ("7+15-2;22-2;20;A:20", "20")


def test_difficulty_mix_controls_operations():
    easy = SyntheticTask(100, {"easy": 1.0}, seed=0)
    hard = SyntheticTask(100, {"hard": 1.0}, seed=0)
    assert {p.difficulty for p in easy} == {"easy"} and {p.difficulty for p in hard} == {"hard"}
    assert max(response_lengths(easy)) < min(response_lengths(hard))
    with pytest.raises(ValueError, match="difficulty.extreme"):
        SyntheticTask(10, {"extreme": 1.0})
    with pytest.raises(ValueError, match="difficulty.easy"):
        SyntheticTask(10, {"easy": -1.0})
    with pytest.raises(ValueError, match="size"):
        SyntheticTask(-1)


def test_default_mix_has_a_long_tail():
    lengths = np.array(response_lengths(SyntheticTask(2000, seed=0)))
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    assert p90 / p50 >= 3.0          # most responses short ...
    assert p99 / p50 >= 7.0          # ... a few very long
    assert np.mean(lengths > 2 * p50) < 0.3


def test_extract_answer():
    assert extract_answer("3+4;7;A:7") == "7"
    assert extract_answer("A:1;A:-12") == "-12"
    assert extract_answer("so she pays 3*4=12 dollars.\n#### 1,234") == "1234"
    assert extract_answer("#### $42.0") == "42"
    assert extract_answer("no answer here 17") is None
    assert normalize_answer(" +3.50 ") == "3.50" and normalize_answer("1,000") == "1000"
    assert not is_correct("A:8", "7") and not is_correct("", "7")


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="is a directory"):
        load_jsonl(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(DatasetError, match="is not a file"):
        load_jsonl(fifo)


def test_jsonl_gsm8k_and_malformed_lines_counted(tmp_path, caplog):
    path = tmp_path / "data.jsonl"
    lines = [
        json.dumps({"prompt": "What is 2+2?", "answer": "2+2=4\n#### 4"}),
        json.dumps({"question": "Natalia sold 48 clips...", "answer": "48/2 = 24\n#### 72"}),  # GSM8K field names
        json.dumps({"prompt": "Bare answer", "answer": 1000}),
        "{not json",
        json.dumps(["a list"]),
        json.dumps({"prompt": "", "answer": "1"}),
        json.dumps({"prompt": "no answer field"}),
        json.dumps({"prompt": "p", "answer": "reasoning #### unknown"}),
        "",
    ]
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        ds = load_jsonl(path)
    assert [p.answer for p in ds.problems] == ["4", "72", "1000"]
    assert ds.problems[1].prompt.startswith("Natalia") and str(ds.problems[0].solution).endswith("#### 4")
    assert ds.malformed == 5
    assert "skipped 5 malformed" in caplog.text and "data.jsonl:4" in caplog.text
    with pytest.raises(DatasetError, match=r"data.jsonl:4: malformed line: invalid JSON"):
        load_jsonl(path, strict=True)
    assert load_problems(str(path)) == ds.problems


def test_jsonl_nothing_valid(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("garbage\n{}\n")
    with pytest.raises(DatasetError, match="no valid lines"):
        load_jsonl(path)
