"""`specrl validate FILE...`: check RLJob YAML files offline, the way the API server would.

One line per problem, `FILE: <metadata.name>: <field.path>: <message>`, on stdout; exit 2 when there is any
problem, 0 otherwise. Never a traceback: unreadable files and broken YAML are problems like any other.
"""

from __future__ import annotations

import argparse
import sys

from specrl.runtime.api import Problem, check_file


def validate_files(paths: list[str]) -> tuple[int, list[Problem]]:
    """(number of valid jobs, every problem) over all files."""
    valid, problems = 0, []
    for path in paths:
        jobs, found = check_file(path)
        valid += len(jobs)
        problems += found
    return valid, problems


def main(args: argparse.Namespace) -> int:
    valid, problems = validate_files(list(args.files))
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} problem(s) in {len({p.source for p in problems})} file(s)",
              file=sys.stderr)
        return 2
    print(f"{valid} RLJob(s) valid", file=sys.stderr)
    return 0
