"""``raytrain-guard experiment`` refuses bad input in one line, exit 2, before any Ray starts."""

from __future__ import annotations

import pytest

from raytrain_guard import cli


@pytest.mark.parametrize("argv,names", [
    (["--max-failures", "-1"], "--max-failures: must be an integer >= 0"),
    (["--micro-batch", "0"], "--micro-batch: must be an integer >= 1"),
    (["--repeat", "0"], "--repeat: must be an integer >= 1"),
    (["--fault", "slow_compute:rank=1,start=-2,factor=3"], "start=-2"),
])
def test_bad_experiment_input_is_one_line_exit_2(argv, names, capsys, monkeypatch):
    import ray
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started on bad input"))
    assert cli.main(["experiment", *argv]) == 2
    err = capsys.readouterr().err
    assert names in err and "Traceback" not in err, err
