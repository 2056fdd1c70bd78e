"""`raytrain-guard status`: token auth for clients, choosing the coordinator, the page, and a
wrong ``--address`` failing in seconds with one line (no cluster needed)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from raytrain_guard.cluster.status import (
    GCS_CONNECT_ENV,
    ClusterUnreachableError,
    NoCoordinatorError,
    _gcs_connect_env,
    check_reachable,
    choose_coordinator,
    enable_token_auth_if_token_exists,
    format_status,
    split_address,
)
from raytrain_guard.errors import InputError

C = "raytrain_guard:coordinator:"


@pytest.mark.parametrize("env, token_file, expected_mode", [
    ({}, False, None),                                    # no token anywhere: leave it alone
    ({}, True, "token"),                                  # ~/.ray/auth_token exists
    ({"RAY_AUTH_TOKEN": "abc"}, False, "token"),          # token in the environment
    ({"RAY_AUTH_MODE": "disabled"}, True, "disabled"),    # the user's explicit choice wins
])
def test_token_auth_is_enabled_only_when_a_token_exists(tmp_path, env, token_file, expected_mode):
    if token_file:
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("secret")
    env = dict(env)
    enable_token_auth_if_token_exists(env, home=tmp_path)
    assert env.get("RAY_AUTH_MODE") == expected_mode


def test_token_path_variable_counts(tmp_path):
    token = tmp_path / "tok"
    token.write_text("x")
    env = {"RAY_AUTH_TOKEN_PATH": str(token)}
    assert enable_token_auth_if_token_exists(env, home=tmp_path / "nohome")
    assert env["RAY_AUTH_MODE"] == "token"


@pytest.mark.parametrize("names, run_id, expected", [
    ([C + "a", "raytrain_guard:monitor:a:n1"], None, C + "a"),   # the only coordinator
    ([C + "a", C + "b"], "b", C + "b"),                         # chosen by run id
])
def test_choose_coordinator(names, run_id, expected):
    assert choose_coordinator(names, run_id, "ns") == expected


@pytest.mark.parametrize("names, run_id, field", [
    ([], None, "--namespace"),                 # nothing running in that namespace
    ([C + "a", C + "b"], None, "--run-id"),    # ambiguous
    ([C + "a"], "zz", "--run-id"),             # no such run
])
def test_choose_coordinator_errors_name_the_flag(names, run_id, field):
    with pytest.raises(NoCoordinatorError) as err:
        choose_coordinator(names, run_id, "ns")
    assert err.value.field == field and isinstance(err.value, InputError)


def test_format_status_shows_ranks_memory_and_decisions():
    page = format_status({
        "coordinator": C + "r1", "latest_step": 40,
        "nodes": {"node-a": {"node_id": "node-a", "host": {"memory_used_frac": 0.5}}},
        "ranks": {"0": {"world_rank": 0, "node_id": "node-a", "step": 40, "step_p50_s": 0.1,
                        "step_p99_s": 0.25, "memory_frac": 0.91, "straggler_score": 0.0}},
        "active_decisions": [{"decision_id": 3, "action": "release_cache", "step": 50,
                              "scope": "cluster", "reason": "node-a at 91%"}],
    })
    assert "latest step 40" in page
    assert "0.100" in page and "0.250" in page and "91%" in page
    assert "#3 release_cache at step 50 [cluster]: node-a at 91%" in page


def test_format_status_leaves_debug_counters_to_json_and_words_what_a_user_needs():
    status = {"coordinator": C + "r1", "run_id": "r1", "attempt": 2, "latest_step": 40,
              "incarnation": "3f2a9c1d0e4b", "num_reports": 120, "num_node_samples": 30,
              "num_rounds": 14, "straggler_nodes": ["node-b"], "notes": ["GPU 1 holds no worker"],
              "ignored": {"stale": 3, "duplicate": 0, "out_of_order": 0, "malformed": 0}}
    page = format_status(status)
    for debug in ("incarnation", "3f2a9c1d0e4b", "num_reports", "num_rounds", "{'stale'"):
        assert debug not in page
    assert page.splitlines()[-4:] == [
        "attempt 2: the worker group restarted 1 time(s)",
        "straggler nodes: node-b",
        "note: GPU 1 holds no worker",
        "ignored reports: 3 stale (from an earlier attempt of the run)"]
    # a quiet first attempt adds nothing after the decisions
    quiet = dict(status, attempt=1, straggler_nodes=[], notes=[],
                 ignored={"stale": 0, "duplicate": 0})
    assert format_status(quiet).splitlines()[-1] == "active decisions (0)"


@pytest.mark.parametrize("address, expected", [
    (None, None), ("auto", None), ("local", None),
    ("10.0.0.1:6379", ("10.0.0.1", 6379)),
    ("ray://head:10001", ("head", 10001)),          # Ray Client
    ("[::1]:6379", ("::1", 6379)),
])
def test_split_address(address, expected):
    assert split_address(address) == expected


@pytest.mark.parametrize("address, words", [
    ("10.0.0.1", "needs host:port"),
    ("10.0.0.1:port", "needs host:port"),
    ("http://127.0.0.1:8265", "dashboard"),        # the job-submission address, not the GCS
])
def test_split_address_refuses_what_is_not_a_cluster_address(address, words):
    with pytest.raises(ClusterUnreachableError) as err:
        split_address(address)
    assert err.value.field == "--address" and words in str(err.value)


class _Conn:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _connect_only(open_hosts):
    def connect(addr, timeout):
        if addr[0] == "bogus":
            raise socket.gaierror(-2, "Name or service not known")
        if addr[0] not in open_hosts:
            raise ConnectionRefusedError(111, "Connection refused")
        return _Conn()
    return connect


def test_check_reachable_says_what_is_wrong_with_the_address():
    check_reachable("10.0.0.1:6379", connect=_connect_only({"10.0.0.1"}))     # listening
    check_reachable(None, connect=_connect_only(set()))                       # auto: Ray's job
    with pytest.raises(ClusterUnreachableError, match="nothing listens on that port "
                       r"\(connection refused\)") as err:
        check_reachable("10.0.0.1:6379", connect=_connect_only(set()))
    assert err.value.field == "--address" and "ray start --head" in err.value.fix
    with pytest.raises(ClusterUnreachableError, match="unknown host 'bogus'"):
        check_reachable("bogus:1", connect=_connect_only(set()))


def test_check_reachable_accepts_a_loopback_address_served_on_the_node_ip():
    # Ray connects to the node IP when given 127.0.0.1 or localhost: that one counts too
    check_reachable("127.0.0.1:6379", connect=_connect_only({"192.0.2.2"}),
                    local_ip=lambda: "192.0.2.2")
    check_reachable("localhost:6379", connect=_connect_only({"192.0.2.2"}),
                    local_ip=lambda: "192.0.2.2")


def test_gcs_connect_env_bounds_ray_and_keeps_the_users_values():
    env = {"RAY_py_gcs_connect_timeout_s": "60"}
    with _gcs_connect_env(env):
        assert env["RAY_py_gcs_connect_timeout_s"] == "60"          # the user's value wins
        assert env["RAY_gcs_server_port_wait_time_s"] == GCS_CONNECT_ENV[
            "RAY_gcs_server_port_wait_time_s"]
    assert env == {"RAY_py_gcs_connect_timeout_s": "60"}            # restored


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("address", ["127.0.0.1:FREE", "bogus:1"])
def test_status_cli_fails_fast_with_one_line_when_nothing_answers(address):
    """Ray alone retries such an address for minutes; the CLI answers in seconds. (The free
    port is taken at run time: test ids must be the same in every pytest-xdist worker.)"""
    address = address.replace("FREE", str(_free_port()))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raytrain_guard.cli", "status", "--address",
                           address], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert took < 20, f"took {took:.0f} s"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raytrain-guard status: error: --address: "), \
        proc.stderr[-2000:]
    assert "ray start --head" in lines[0] and proc.stdout == ""
