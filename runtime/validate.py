"""`specrl validate FILE|DIR|- ... [-o json]`: check RLJob YAML offline, the way the API server would.

Text output: one line per problem on stdout, `FILE: <metadata.name>: <field.path>: <message>` (a problem of the
whole file, such as `missing.yaml: cannot read file: ...`, has no name or field), notes and the summary on
stderr. JSON output: one object on stdout, `{"valid": [...], "problems": [...], "skipped": [...]}`.
Exit 0 when every RLJob is valid, 1 when there is any problem. Never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .api import Problem, check_text, read_problem

YAML_SUFFIXES = (".yaml", ".yml", ".json")  # JSON is YAML 1.2; kubectl reads both


@dataclass
class Report:
    valid: list[dict[str, str]] = field(default_factory=list)  # {"source", "name"} of every valid RLJob
    problems: list[Problem] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"source", "object": "Kind/name"}, other kinds

    def to_json(self) -> dict[str, object]:
        return {"valid": self.valid, "problems": [asdict(p) for p in self.problems], "skipped": self.skipped}


def _sources(arg: str) -> tuple[list[tuple[str, Path | None]], bool]:
    """(display name, path or None for stdin) of each YAML source an argument names, and whether it is a
    directory (whose files without any RLJob are skipped, not problems: manifests of other kinds live there too)."""
    if arg == "-":
        return [("<stdin>", None)], False
    path = Path(arg)
    if path.is_dir():
        return [(str(p), p) for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in YAML_SUFFIXES], True
    return [(arg, path)], False


def _read(path: Path | None) -> str:
    if path is not None:
        return path.read_text(encoding="utf-8")
    if sys.stdin is None:  # started with standard input closed (`specrl validate - <&-`)
        raise OSError(errno.EBADF, "standard input is closed")
    return sys.stdin.read()


def validate(args: list[str]) -> Report:
    report = Report()
    for arg in args:
        sources, directory = _sources(arg)
        rljob_files = 0
        for name, path in sources:
            try:
                text = _read(path)
            except (OSError, UnicodeDecodeError) as exc:
                report.problems.append(read_problem(name, exc))
                continue
            found = check_text(text, name, among_others=directory)
            rljob_files += not found.none_found
            report.valid += [{"source": name, "name": job.metadata.name} for job in found.jobs]
            report.skipped += [{"source": name, "object": what} for what in found.skipped]
            if not (directory and found.none_found):  # a named file must hold an RLJob; a directory's need not
                report.problems += found.problems
        if directory and not rljob_files:
            report.problems.append(Problem(arg, "", "", "no RLJob in any *.yaml, *.yml or *.json file here"))
    return report


def main(args: argparse.Namespace) -> int:
    if list(args.files).count("-") > 1:  # the second read would find standard input empty
        print("specrl validate: - (standard input) can be given only once", file=sys.stderr)
        return 2
    report = validate(list(args.files))
    if getattr(args, "output", "text") == "json":
        print(json.dumps(report.to_json(), indent=2))
    else:
        for problem in report.problems:
            print(problem)
        for item in report.skipped:
            print(f"note: {item['source']}: {item['object']}: not an RLJob, skipped", file=sys.stderr)
        if report.problems:
            files = len({p.source for p in report.problems})
            print(f"{len(report.problems)} problem(s) in {files} file(s); {len(report.valid)} RLJob(s) valid",
                  file=sys.stderr)
        else:
            print(f"{len(report.valid)} RLJob(s) valid", file=sys.stderr)
    return 1 if report.problems else 0
