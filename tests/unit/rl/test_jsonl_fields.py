"""spec.dataset.promptField / answerField reach the JSONL loader (and the settings the workers read)."""

import json

import pytest
from specrl.runtime.api import RLJob
from specrl.runtime.rl.settings import RunSettings
from specrl.runtime.rl.task import DatasetError, load_jsonl, load_problems


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_custom_fields_are_read(tmp_path):
    path = _write(tmp_path / "d.jsonl", [
        {"input": "What is 3+4?", "target": "7", "prompt": "ignored", "answer": "0"},
        {"input": "Worked", "target": "1+1=2\n#### 2"},
        {"input": "no target here"},        # malformed: the configured answer key is missing
        {"prompt": "default keys only", "answer": "5"},  # malformed under the custom keys
    ])
    ds = load_jsonl(path, prompt_field="input", answer_field="target")
    assert [(p.prompt, p.answer) for p in ds.problems] == [("What is 3+4?", "7"), ("Worked", "2")]
    assert ds.malformed == 2
    with pytest.raises(DatasetError, match=r"d.jsonl:3: malformed line: target: field required"):
        load_jsonl(path, prompt_field="input", answer_field="target", strict=True)
    assert load_problems(str(path), prompt_field="input", answer_field="target") == ds.problems
    # the defaults still read `prompt`/`answer` from the same file
    assert [p.answer for p in load_jsonl(path).problems] == ["0", "5"]


def test_settings_carry_the_fields(tmp_path):
    job = RLJob.model_validate({
        "apiVersion": "specrl.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "j"},
        "spec": {"model": {"name": "builtin:tiny"},
                 "dataset": {"type": "jsonl", "path": str(tmp_path / "d.jsonl"),
                             "promptField": "input", "answerField": "target"}},
    })
    s = RunSettings.from_job(job)
    assert (s.prompt_field, s.answer_field) == ("input", "target")
    assert RunSettings.from_job(RLJob.model_validate({
        "apiVersion": "specrl.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "j"},
        "spec": {"model": {"name": "builtin:tiny"}}})).prompt_field == "prompt"
