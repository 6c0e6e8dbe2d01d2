"""What `specrl worker` puts in the environment of its Ray processes (runtime/worker.py)."""

import pytest
from specrl.runtime.worker import WorkerError, _extra_ray_args, pin_ray_auth


def test_job_token_is_the_ray_token_on_every_node():
    # Every pod of a job gets SPECRL_COORDINATOR_TOKEN: with it as the Ray token, head, nodes and driver agree.
    assert pin_ray_auth({"SPECRL_COORDINATOR_TOKEN": "t0k"}) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t0k"}


def test_no_token_means_auth_explicitly_off():
    # Left unset, Ray would switch a head to token mode because of a ~/.ray/auth_token in its home directory.
    assert pin_ray_auth({}) == {"RAY_AUTH_MODE": "disabled"}
    assert pin_ray_auth({"SPECRL_COORDINATOR_TOKEN": ""}) == {"RAY_AUTH_MODE": "disabled"}


def test_explicit_ray_settings_win():
    assert pin_ray_auth({"RAY_AUTH_MODE": "disabled", "SPECRL_COORDINATOR_TOKEN": "t0k"}) == {}
    assert pin_ray_auth({"SPECRL_COORDINATOR_TOKEN": "t0k", "RAY_AUTH_TOKEN_PATH": "/secret/ray"}) == {
        "RAY_AUTH_MODE": "token"}


def test_extra_ray_start_args(monkeypatch):
    monkeypatch.delenv("SPECRL_RAY_START_ARGS", raising=False)
    assert _extra_ray_args() == []
    monkeypatch.setenv("SPECRL_RAY_START_ARGS", "--temp-dir='/tmp/a b' --dashboard-agent-listen-port=1234")
    assert _extra_ray_args() == ["--temp-dir=/tmp/a b", "--dashboard-agent-listen-port=1234"]
    monkeypatch.setenv("SPECRL_RAY_START_ARGS", "--temp-dir='/tmp")
    with pytest.raises(WorkerError, match="SPECRL_RAY_START_ARGS"):
        _extra_ray_args()
