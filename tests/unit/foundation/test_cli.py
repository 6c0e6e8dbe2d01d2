"""The `specrl` command line as a user meets it: --version, --help of every command, exit codes (0 ok,
1 failure, 2 usage), `validate` on stdin/directories/Lists/multi-kind files/-o json, and the commands that must
work on the base install (no torch, no Ray) really running without them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from specrl.runtime.cli import HANDLERS, build_parser

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny-local.yaml"

# Runs the CLI with the runtime extra made unimportable, as on `pip install specrl` without `[runtime]`.
BASE_INSTALL = textwrap.dedent("""
    import importlib.abc, sys
    class NoRuntimeExtra(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"torch", "transformers", "safetensors", "ray", "scipy", "matplotlib"}:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, NoRuntimeExtra())
    from specrl.runtime.cli import main
    code = main(sys.argv[1:])
    leaked = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "ray", "transformers"})
    assert not leaked, leaked
    sys.exit(code)
""")


def _specrl(*args: str, stdin: str | None = None, base_install: bool = False,
            cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    head = ["-c", BASE_INSTALL] if base_install else ["-m", "specrl.runtime.cli"]
    return subprocess.run([sys.executable, *head, *args], input=stdin, capture_output=True, text=True, timeout=120,
                          cwd=cwd, check=False)


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[f"{prefix}{name}"] = sub
                out.update(_subparsers(sub, f"{prefix}{name} "))
    return out


def test_version() -> None:
    proc = _specrl("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("specrl 0.") and len(proc.stdout.splitlines()) == 1


def test_every_command_has_its_own_help_documenting_each_argument() -> None:
    subs = _subparsers(build_parser())
    assert set(HANDLERS) <= set(subs)
    descriptions = [sub.description for sub in subs.values()]
    assert all(descriptions) and len(set(descriptions)) == len(descriptions)
    for name, sub in subs.items():
        assert "exit codes: 0 success, 1 failure" in (sub.epilog or ""), name
        for action in sub._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"specrl {name}: {action.option_strings or action.dest} has no help text"
    proc = _specrl("validate", "--help")
    assert proc.returncode == 0 and "(standard input)" in proc.stdout and "exit codes" in proc.stdout


@pytest.mark.parametrize("args", [
    ("crd", "--check", "--write"),
    ("validate",),
    ("nosuchcommand",),
    ("run", str(TINY), "--steps", "0"),
    ("run", str(TINY), "--steps", "1000001"),  # spec.algorithm.steps' own bound
    ("operator", "--metrics-port", "70000"),
    ("operator", "--poll-interval", "0"),
    ("operator", "--poll-interval", "nan"),
    ("validate", "-", "-"),
    ("operator", "--default-job-image", "not an image"),
    ("bench", "sync", "--repeats", "0"),
    ("bench", "prefetch", "--repeats", "0"),
    ("simulate",),
    ("simulate", "--preset", "nope"),
])
def test_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    proc = _specrl(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip()


def test_validate_reads_stdin_directories_lists_and_skips_other_kinds(tmp_path: Path) -> None:
    job = TINY.read_text()
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "job.yml").write_text(job)
    (tmp_path / "d" / "notes.txt").write_text("not yaml: [")
    (tmp_path / "d" / "service.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: web}\n")
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: coord}\n---\n" + job)
    # what `kubectl get rlj -o yaml` prints: a List whose items are the objects
    listed = tmp_path / "list.yaml"
    listed.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "metadata": {},
                                  "items": [{**_doc(job), "metadata": {"name": f"j{i}"}} for i in range(2)]}))
    proc = _specrl("validate", "-", str(tmp_path / "d"), str(mixed), str(listed), stdin=job)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert f"note: {mixed}: Service/coord: not an RLJob, skipped" in proc.stderr
    assert "5 RLJob(s) valid" in proc.stderr
    assert f"note: {tmp_path / 'd' / 'service.yaml'}: Service/web: not an RLJob, skipped" in proc.stderr
    # A directory's files may hold other kinds only; a file named on the command line must hold an RLJob, and a
    # broken file is a problem wherever it is.
    (tmp_path / "d" / "broken.yaml").write_text("a: [1\n")
    (tmp_path / "empty").mkdir()
    proc = _specrl("validate", str(tmp_path / "d"), str(tmp_path / "d" / "service.yaml"), str(tmp_path / "empty"))
    assert proc.returncode == 1
    assert sorted(proc.stdout.splitlines()) == sorted([
        f"{tmp_path / 'd' / 'broken.yaml'}: invalid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>'",
        f"{tmp_path / 'd' / 'service.yaml'}: no RLJob found (skipped Service/web)",
        f"{tmp_path / 'empty'}: no RLJob in any *.yaml, *.yml or *.json file here"])


def test_validate_skips_a_directorys_files_that_are_no_kubernetes_object(tmp_path: Path) -> None:
    from specrl.runtime.validate import validate
    job = TINY.read_text()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "job.yaml").write_text(job)
    (tmp_path / "d" / "values.yaml").write_text("image: {repository: x}\nreplicaCount: 1\n")
    (tmp_path / "d" / "Chart.yaml").write_text("apiVersion: v2\nname: mine\nversion: 0.1.0\n")
    (tmp_path / "d" / "prompts.json").write_text('[{"prompt": "2+2?"}]')
    report = validate([str(tmp_path / "d")])
    assert report.problems == [] and len(report.valid) == 1
    assert sorted(s["source"] for s in report.skipped) == sorted(
        str(tmp_path / "d" / f) for f in ("Chart.yaml", "prompts.json", "values.yaml"))
    assert {s["object"] for s in report.skipped} == {"a document without kind"}
    # An RLJob whose kind was forgotten still has metadata and spec: a problem in a directory too. Named on the
    # command line, a file must hold an RLJob whatever it holds.
    forgot = "\n".join(line for line in job.splitlines() if not line.startswith("kind:"))
    (tmp_path / "d" / "forgot.yaml").write_text(forgot)
    report = validate([str(tmp_path / "d"), str(tmp_path / "d" / "values.yaml")])
    found = {(p.source, p.path) for p in report.problems}
    assert {path for source, path in found if source == str(tmp_path / "d" / "forgot.yaml")} == {"kind"}
    assert (str(tmp_path / "d" / "values.yaml"), "kind") in found
    assert {source for source, _ in found} == {str(tmp_path / "d" / f) for f in ("forgot.yaml", "values.yaml")}


def test_validate_with_standard_input_closed_is_a_problem_not_a_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "specrl.runtime.cli", "validate", "-", str(TINY)], stdin=None,
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
                          preexec_fn=lambda: os.close(0))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == "<stdin>: cannot read file: standard input is closed\n"
    assert "1 RLJob(s) valid" in proc.stderr


def _checkpoint(root: Path, config: str | None = None) -> Path:
    """A checkpoint folder as the trainer writes it, with a policy/ that transformers cannot load."""
    ckpt = root / "step-000001"
    (ckpt / "policy").mkdir(parents=True)
    (ckpt / "trainer.pt").write_bytes(b"")
    (ckpt / "policy" / "README").write_text("no weights\n")
    if config is not None:
        (ckpt / "policy" / "config.json").write_text(config)
    return ckpt


@pytest.mark.parametrize(("summary", "expected"), [
    ("not json", "summary.json: invalid JSON at line 1, column 1: Expecting value"),
    ("[1]", "summary.json: expected a JSON object (a run's summary), got list"),
    ('{"checkpoint_dir": 5}', "summary.json: checkpoint_dir: must be a valid string"),
])
def test_export_bad_run_summary_names_the_file(tmp_path: Path, summary: str, expected: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(summary)
    proc = _specrl("export", str(run), str(tmp_path / "out"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr == f"specrl export: {run / expected}\n"


@pytest.mark.parametrize("out", ["afile", "afile/sub"])
def test_export_to_a_file_is_one_line(tmp_path: Path, out: str) -> None:
    (tmp_path / "afile").write_text("x")
    proc = _specrl("export", str(_checkpoint(tmp_path / "ck")), out, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr == ("specrl export: afile: exists and is not a directory\n" if out == "afile" else
                           "specrl export: afile/sub: afile is not a directory\n")


def test_export_dtype_failure_names_the_checkpoint_and_leaves_nothing(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ck", config="{}")
    proc = _specrl("export", str(ckpt), "out", "--dtype", "bfloat16", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"specrl export: {ckpt / 'policy'}: cannot load the policy to cast it to bfloat16: ")
    assert "export-tmp" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no out/, no out.export-tmp/


def _doc(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


def test_validate_json_output_and_exit_1_on_problems(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: typo}\n"
                   "spec: {algorithm: {steps: 2000000000, promptsPerStep: 8000000}, resources: {totalGPUs: 10000000}}\n")
    proc = _specrl("validate", "-o", "json", str(TINY), str(bad), str(tmp_path / "missing.yaml"))
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["valid"] == [{"source": str(TINY), "name": "tiny-local"}]
    paths = {(p["source"], p["path"]) for p in out["problems"]}
    # absurd numbers are caught, all in one pass
    assert {(str(bad), "spec.algorithm.steps"), (str(bad), "spec.algorithm.promptsPerStep"),
            (str(bad), "spec.resources.totalGPUs")} <= paths
    assert {"source": str(tmp_path / "missing.yaml"), "name": "", "path": "",
            "message": "cannot read file: No such file or directory"} in out["problems"]
    text = _specrl("validate", str(tmp_path / "missing.yaml"))
    assert text.returncode == 1
    assert text.stdout == f"{tmp_path / 'missing.yaml'}: cannot read file: No such file or directory\n"


def test_base_install_runs_validate_crd_and_simulate_without_torch() -> None:
    proc = _specrl("validate", str(TINY), base_install=True)
    assert proc.returncode == 0, proc.stderr
    assert _specrl("crd", "--check", base_install=True).returncode == 0
    listing = _specrl("simulate", "--list", base_install=True)
    assert listing.returncode == 0, listing.stderr
    preset = listing.stdout.split(":", 1)[0]
    sim = _specrl("simulate", "--preset", preset, base_install=True)
    assert sim.returncode == 0, sim.stderr
    assert "rollout speedup" in sim.stdout


@pytest.mark.parametrize("args", [("run", str(TINY)), ("bench", "rollout", "--quick"), ("bench", "prefetch", "--quick")])
def test_base_install_runtime_commands_say_what_to_install(args: tuple[str, ...]) -> None:
    proc = _specrl(*args, base_install=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith("install the runtime extra: pip install 'specrl[runtime]'")
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_operator_and_hook_need_no_kubernetes_client() -> None:
    # The operator's client is its own adapter on kopf's login (operator/README.md); `kubernetes` is a test extra.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("kubernetes") for d in meta["dependencies"])
    # kopf imports the official client when it is installed (to offer its login); the operator must not need it.
    code = textwrap.dedent("""
        import importlib.abc, runpy, sys
        class NoKubernetesClient(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"kubernetes", "pykube"}:
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NoKubernetesClient())
        import specrl.operator.main, specrl.operator.handlers, specrl.operator.kube
        hook = runpy.run_path("charts/specrl/files/helm-test.py", run_name="hook")
        ok, message = hook["crd_established"]("rljobs.specrl.io")
        assert not ok and "credentials" in message, message
    """)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False, env=env)
    assert proc.returncode == 0, proc.stderr
