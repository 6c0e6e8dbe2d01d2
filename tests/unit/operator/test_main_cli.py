"""`specrl operator` refuses bad set-ups with one clear line (kopf would retry forever): exit 1 for a bad
environment, 2 for a bad command line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

SPECRL = str(Path(sys.executable).parent / "specrl")


@pytest.mark.parametrize("setup,expected,code", [
    ("missing", "cannot read kubeconfig", 1),
    ("bad-yaml", "is not valid YAML", 1),
    ("no-clusters", "defines no clusters", 1),
    ("bad-template", "--coordinator-url-template", 2),
    ("not-utf8", "is not UTF-8 text", 1),
    ("equal-ports", "--health-port: must differ from --metrics-port (both 18093)", 2),
    ("health-port-in-use", "--health-port PORT: Address already in use", 1),
])
def test_operator_rejects_bad_setups(tmp_path: Path, setup: str, expected: str, code: int):
    kc = tmp_path / "kubeconfig"
    args = [SPECRL, "operator", "--metrics-port", "0", "--health-port", "0"]
    if setup == "bad-yaml":
        kc.write_text("a: [")
    elif setup == "no-clusters":
        kc.write_text("apiVersion: v1\nkind: Config\n")
    elif setup == "bad-template":
        kc.write_text("clusters: [{name: x, cluster: {server: 'http://127.0.0.1:1'}}]\n")
        args += ["--coordinator-url-template", "http://{job}.svc"]
    elif setup == "not-utf8":
        kc.write_bytes(b"clusters: [\xff]\n")
    elif setup == "equal-ports":
        args = [SPECRL, "operator", "--metrics-port", "18093", "--health-port", "18093"]
    busy = socket.socket()
    if setup == "health-port-in-use":
        kc.write_text("clusters: [{name: x, cluster: {server: 'http://127.0.0.1:1'}}]\n")
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args[-1] = str(busy.getsockname()[1])
        expected = expected.replace("PORT", args[-1])
    with busy:
        proc = subprocess.run(args, env={"KUBECONFIG": str(kc), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == code, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "soon"])
def test_poll_interval_must_be_a_positive_finite_number(value: str):
    proc = subprocess.run([SPECRL, "operator", f"--poll-interval={value}"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2
    assert "argument --poll-interval: must be a" in proc.stderr and "Traceback" not in proc.stderr


# kopf's retry budget cut from ~55 s to 0.2 s; everything else is `specrl operator` as shipped.
FAST_RETRIES = """
import sys
from specrl.operator import main as om
shipped = om.settings
def settings(args):
    s = shipped(args)
    s.networking.error_backoffs = [0.1, 0.1]
    return s
om.settings = settings
from specrl.runtime.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_unreachable_api_server_ends_with_one_line_naming_it(tmp_path: Path):
    kc = tmp_path / "kubeconfig"
    kc.write_text("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
                  "users: [{name: u, user: {token: abc}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
                  "current-context: x\n")
    proc = subprocess.run([sys.executable, "-c", FAST_RETRIES, "operator", "--metrics-port", "0", "--health-port", "0"],
                          env={"KUBECONFIG": str(kc), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Request attempt #3/3 failed" in proc.stderr  # the retries are kept (and logged)
    assert proc.stderr.splitlines()[-1] == ("specrl operator: Kubernetes API server https://127.0.0.1:1 unreachable: "
                                            "Connect call failed ('127.0.0.1', 1)")


def test_unreachable_line_without_a_kubeconfig_address():
    from specrl.operator.main import unreachable_line

    assert unreachable_line(TimeoutError(), None) == "Kubernetes API server (unknown address) unreachable: TimeoutError"
    err = ConnectionRefusedError(111, "Connect call failed")
    setattr(err, "host", "10.0.0.1")  # what aiohttp's ClientConnectorError has  # noqa: B010
    setattr(err, "port", 6443)  # noqa: B010
    assert unreachable_line(err, None) == "Kubernetes API server 10.0.0.1:6443 unreachable: Connect call failed"
