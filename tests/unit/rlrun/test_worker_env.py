"""What `specrl worker` puts in the environment of its Ray processes (runtime/worker.py)."""

import pytest
from specrl.runtime.worker import (
    HEAD_PORT,
    WorkerEnv,
    WorkerError,
    _extra_ray_args,
    pin_ray_auth,
    wait_for_coordinator,
)


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


@pytest.mark.parametrize(("var", "value", "message"), [
    ("SPECRL_CONNECT_TIMEOUT", "abc", ("SPECRL_CONNECT_TIMEOUT: must be a valid number, unable to parse string as "
                                       "a number, got 'abc'")),
    ("SPECRL_CONNECT_TIMEOUT", "-5", "SPECRL_CONNECT_TIMEOUT: must be greater than 0, got '-5'"),
    ("SPECRL_CONNECT_TIMEOUT", "inf", "SPECRL_CONNECT_TIMEOUT: must be a finite number, got 'inf'"),
    ("SPECRL_COORDINATOR_ADDR", "bad host:80", "SPECRL_COORDINATOR_ADDR: expected host:port, got 'bad host:80'"),
    ("SPECRL_COORDINATOR_ADDR", "coordinator", "SPECRL_COORDINATOR_ADDR: expected host:port, got 'coordinator'"),
    ("SPECRL_RAY_HEAD_PORT", "abc", ("SPECRL_RAY_HEAD_PORT: must be a valid integer, unable to parse string as an "
                                     "integer, got 'abc'")),
    ("SPECRL_RAY_HEAD_PORT", "70000", "SPECRL_RAY_HEAD_PORT: must be less than or equal to 65535, got '70000'"),
    ("SPECRL_RAY_ADDRESS", "127.0.0.1:99999", "SPECRL_RAY_ADDRESS: port must be in 1..65535, got '127.0.0.1:99999'"),
    ("SPECRL_HTTP_PORT", "0", "SPECRL_HTTP_PORT: must be greater than or equal to 1, got '0'"),
])
def test_bad_environment_settings_name_the_variable(var, value, message):
    with pytest.raises(WorkerError) as info:
        WorkerEnv.from_env({var: value})
    assert str(info.value) == message


def test_environment_settings_defaults_and_good_values():
    env = WorkerEnv.from_env({"SPECRL_CONNECT_TIMEOUT": "", "SPECRL_RAY_ADDRESS": "demo-coordinator.team-a.svc:6379",
                              "SPECRL_COORDINATOR_ADDR": "[::1]:8000", "SPECRL_CONNECT_TIMEOUT_X": "junk"})
    assert env.connect_timeout is None and env.ray_head_port == HEAD_PORT  # empty is unset
    assert env.ray_address == "demo-coordinator.team-a.svc:6379" and env.coordinator_addr == "[::1]:8000"
    assert WorkerEnv.from_env({"SPECRL_CONNECT_TIMEOUT": "1.5"}).connect_timeout == 1.5


def test_out_of_range_ray_port_is_rejected_not_retried():
    with pytest.raises(WorkerError, match=r"^SPECRL_RAY_ADDRESS: port must be in 1..65535"):
        wait_for_coordinator(None, "127.0.0.1:99999", timeout_s=60)
