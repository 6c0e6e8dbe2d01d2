"""`specrl validate`, `specrl crd`, the generated CRD's shape, and the packaging promise about `operator`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from specrl.runtime import crd as crdmod
from specrl.runtime.api import load_yaml_documents
from specrl.runtime.validate import main as validate_main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _specrl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(check=False, args=[sys.executable, "-m", "specrl.runtime.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


# ----------------------------------------------------------------------------------------------------------
# specrl validate


def test_validate_examples_exit_0() -> None:
    assert len(EXAMPLES) >= 3
    proc = _specrl("validate", *map(str, EXAMPLES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert f"{len(EXAMPLES)} RLJob(s) valid" in proc.stderr


def _run_validate(capsys: pytest.CaptureFixture[str], *files: Path) -> tuple[int, list[str]]:
    code = validate_main(argparse.Namespace(files=[str(f) for f in files], output="text"))
    out = capsys.readouterr().out
    return code, out.splitlines()


def test_validate_reports_each_problem_on_its_own_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "jobs.yaml"
    f.write_text(
        "apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: one}\n"
        "spec:\n  algorithm: {steps: 0, bogus: 1}\n  resources: {rollout: {replicas: 1, minReplicas: 2}}\n"
        "---\n"
        "apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: two}\nspec: {mode: async, maxStaleness: 0}\n"
        "---\n"
        "apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: three}\n")
    code, lines = _run_validate(capsys, f)
    assert code == 1
    assert f"{f}: one: spec.algorithm.steps: must be greater than or equal to 1" in lines
    assert f"{f}: one: spec.algorithm.bogus: unknown field" in lines
    assert f"{f}: two: spec.maxStaleness: async mode needs maxStaleness >= 1" in lines
    assert not any(": three:" in line for line in lines)
    # Field problems and the cross-field rule of a sibling part come out in the same pass.
    assert f"{f}: one: spec.resources.rollout.minReplicas: must be <= replicas (1)" in lines
    for line in lines:
        assert line.startswith(f"{f}: ") and line.count(": ") >= 3


@pytest.mark.parametrize(("content", "expected"), [
    ("a: [1, 2\n", "invalid YAML at line 2"),
    ("- just\n- a list\n", "in.yaml: expected a mapping (an RLJob object), got list"),
    ("", "no RLJob found (the file is empty)"),
    ("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n", "in.yaml: no RLJob found (skipped Pod/p)"),
    ("apiVersion: v2\nkind: RLJob\nmetadata: {name: p}\n", "p: apiVersion: must be 'specrl.io/v1alpha1' (got 'v2')"),
    ("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nspec: {}\n", "<unnamed>: metadata.name: required field is missing"),
    ("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: Job_1}\n", "Job_1: metadata.name: "),
    ("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: j}\nspec: {suspend: maybe}\n",
     "j: spec.suspend: must be a valid boolean"),
    ("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: j}\nspec: {resources: {totalGPUs: 1}}\n",
     "j: spec.resources.totalGPUs: (trainer.replicas + rollout.replicas) x gpusPerPod = 2 GPUs exceeds totalGPUs 1"),
    ("---\n- 1\n---\napiVersion: v2\nkind: RLJob\n", "<document 1>: <document>: expected a mapping"),
    ("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: j}\nspec:\n  mode: sync\n  mode: async\n",
     "invalid YAML at line 6, column 3: duplicate key 'mode'"),
    ("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: j}\n? [x, y]\n: 1\n",
     "in.yaml: invalid YAML at line 4, column 3: found unhashable key"),
    ("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: j}\n? {x: 1}\n: 1\n",
     "in.yaml: invalid YAML at line 4, column 3: found unhashable key"),
    ("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: j}\nspec: {algorithm: {steps: " + "9" * 5000 + "}}\n",
     "in.yaml: invalid YAML at line 4, column 27: integer too large"),
])
def test_validate_bad_input_is_a_problem_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         content: str, expected: str) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(content)
    code, lines = _run_validate(capsys, f)
    assert code == 1
    assert any(expected in line for line in lines), lines


def test_validate_deep_nesting_is_a_problem_of_that_file_only(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: a}\nspec: {model: "
                    + "[" * 5000 + "]" * 5000 + "}\n")
    good = tmp_path / "good.yaml"
    good.write_text(EXAMPLES[0].read_text())
    code = validate_main(argparse.Namespace(files=[str(deep), str(good)], output="json"))
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [(p["source"], p["message"]) for p in report["problems"]] == \
        [(str(deep), "invalid YAML at line 4, column 113: nested more than 100 levels deep")]
    assert [v["source"] for v in report["valid"]] == [str(good)]


def test_validate_json_output_survives_unhashable_keys(tmp_path: Path) -> None:
    f = tmp_path / "key.yaml"
    f.write_text("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: a}\n? [x, y]\n: 1\n")
    proc = _specrl("validate", "-o", "json", str(f))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["problems"][0]["message"] == "invalid YAML at line 4, column 3: found unhashable key"


def test_validate_messages_echo_a_short_form_of_huge_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Five anchors expand to 10^5 strings: the message names the field and the value's shape, not the value.
    f = tmp_path / "lol.yaml"
    f.write_text("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: lol}\nx:\n"
                 "  a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
                 + "".join(f"  {n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcd", "bcde"))
                 + "spec:\n  algorithm: {steps: *e}\n  suspend: " + "x" * 500 + "\n")
    code, lines = _run_validate(capsys, f)
    assert code == 1
    assert f"{f}: lol: spec.algorithm.steps: must be a valid integer (got a list of 10 items)" in lines
    suspend = next(line for line in lines if ": spec.suspend: " in line)
    assert suspend.endswith(f"(got str '{'x' * 76}...)")
    assert all(len(line) < 300 for line in lines), [len(line) for line in lines]


def test_validate_unreadable_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    code, lines = _run_validate(capsys, tmp_path / "missing.yaml", binary)
    assert code == 1
    assert lines[0] == f"{tmp_path / 'missing.yaml'}: cannot read file: No such file or directory"
    assert lines[1].startswith(f"{binary}: cannot read file: ")


def test_validate_cli_never_prints_a_traceback(tmp_path: Path) -> None:
    f = tmp_path / "x.yaml"
    f.write_text("{{{")
    proc = _specrl("validate", str(f), str(tmp_path / "nope.yaml"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    assert len(proc.stdout.splitlines()) == 2


# ----------------------------------------------------------------------------------------------------------
# specrl crd


def test_crd_check_passes_in_the_repository() -> None:
    proc = _specrl("crd", "--check")
    assert proc.returncode == 0, proc.stderr
    assert (ROOT / "crds" / "specrl.io_rljobs.yaml").read_text() == crdmod.render_crd()


def test_crd_check_detects_stale_copies_and_write_fixes_them(tmp_path: Path) -> None:
    (tmp_path / "crds").mkdir()
    (tmp_path / "charts" / "specrl" / "crds").mkdir(parents=True)
    (tmp_path / "crds" / "specrl.io_rljobs.yaml").write_text(crdmod.render_crd())
    (tmp_path / "charts" / "specrl" / "crds" / "specrl.io_rljobs.yaml").write_text("# stale\n")
    proc = _specrl("crd", "--check", cwd=tmp_path)
    assert proc.returncode == 1
    assert "charts/specrl/crds/specrl.io_rljobs.yaml: stale" in proc.stderr
    assert "crds/specrl.io_rljobs.yaml: stale" not in proc.stderr.replace("charts/specrl/crds", "")
    assert _specrl("crd", "--write", cwd=tmp_path).returncode == 0
    assert _specrl("crd", "--check", cwd=tmp_path).returncode == 0


def test_crd_print_is_the_generated_document() -> None:
    proc = _specrl("crd")
    assert proc.returncode == 0
    assert proc.stdout == crdmod.render_crd()
    assert yaml.safe_load(proc.stdout)["kind"] == "CustomResourceDefinition"


def _walk(node: Any, path: str = ""):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def test_crd_is_structural_and_documented() -> None:
    crd = crdmod.build_crd()
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    assert crd["spec"]["names"]["shortNames"] == ["rlj"]
    assert "specrl" in crd["spec"]["names"]["categories"]
    assert version["subresources"] == {"status": {}}
    assert schema["properties"]["status"]["x-kubernetes-preserve-unknown-fields"] is True
    assert [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority", 0) == 0] == \
        ["Phase", "Step", "Trainer", "Rollout", "Accept", "Tail", "Age"]
    for path, node in _walk(schema):
        assert "$ref" not in node and "$defs" not in node and "title" not in node, path
        assert node.get("additionalProperties") is not False, path
        assert "oneOf" not in node and "allOf" not in node, path
        if "anyOf" in node:  # only the int-or-string form is structural
            assert node.get("x-kubernetes-int-or-string") is True, path
        if "properties" in node:
            assert node.get("type") == "object", path
            for name, sub in node["properties"].items():
                if not path.startswith("/properties/metadata"):
                    assert sub.get("description"), f"{path}/properties/{name} has no description"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
        if "default" in node:  # defaults must be valid against their own schema
            jsonschema.Draft4Validator(crdmod.to_json_schema(node)).validate(node["default"])
    rules = [r for _p, n in _walk(schema) for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) >= 15
    assert all(r["message"] and r["rule"] for r in rules)


def test_every_example_validates_against_the_crd_schema_and_bad_ones_do_not() -> None:
    schema = crdmod.to_json_schema(crdmod.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    validator = jsonschema.Draft4Validator(schema)
    for example in EXAMPLES:
        for doc in load_yaml_documents(example.read_text()):
            errors = list(validator.iter_errors(doc))
            assert not errors, (example.name, [e.message for e in errors])
    doc = load_yaml_documents(EXAMPLES[0].read_text())[0]
    for bad_spec in ({"algorithm": {"steps": 0}}, {"mode": "later"}, {"resources": {"gpusPerPod": "1"}},
                     {"speculative": {"method": "eagle3", "numSpeculativeTokens": 100}}, {"unknownField": True}):
        bad = json.loads(json.dumps(doc))
        bad["spec"].update(bad_spec)
        assert list(validator.iter_errors(bad)), bad_spec
    bad = json.loads(json.dumps(doc))
    bad["metadata"]["name"] = "Not_A_Label"
    assert list(validator.iter_errors(bad))


# ----------------------------------------------------------------------------------------------------------
# Packaging


def test_import_operator_from_repo_root_is_the_standard_library() -> None:
    code = "import operator, specrl.operator; print(operator.__file__); print(hasattr(operator, 'itemgetter'))"
    proc = subprocess.run(check=False, args=[sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert not first.startswith(str(ROOT)) and second == "True"


def test_runtime_api_imports_no_torch_or_kubernetes() -> None:
    code = ("import sys, specrl.runtime.api, specrl.runtime.crd, specrl.runtime.validate; "
            "print(sorted(m for m in ('torch', 'kopf', 'kubernetes', 'ray') if m in sys.modules))")
    proc = subprocess.run(check=False, args=[sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_cache_dir_honours_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specrl.runtime.paths import cache_dir

    monkeypatch.setenv("SPECRL_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir("models") == tmp_path / "c" / "models" and (tmp_path / "c" / "models").is_dir()
    monkeypatch.delenv("SPECRL_CACHE_DIR")
    assert cache_dir(create=False) == Path.home() / ".cache" / "specrl"


@pytest.mark.parametrize("version", ["1.30", "1.33"])
def test_crd_object_is_valid_for_the_api_server(version: str) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(crdmod.build_crd(), version, strict=True)
