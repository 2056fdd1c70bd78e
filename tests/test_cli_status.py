"""`raytrain-guard status`: token auth for clients, choosing the coordinator, the page."""

from __future__ import annotations

import pytest

from raytrain_guard.cluster.status import (
    NoCoordinatorError, choose_coordinator, enable_token_auth_if_token_exists, format_status)
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
