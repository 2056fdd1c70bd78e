"""A rank's run setup as the coordinator rebuilds it from a report (pure)."""

from __future__ import annotations

import pytest

from raytrain_guard.core.node_samples import RunSetup


def test_a_reported_setup_is_rebuilt_and_absent_fields_stay_unknown():
    setup = RunSetup.from_dict({"micro_batch": 8, "grad_accum": 2, "device_index": 0,
                                "num_workers": 0, "device": "cpu"})
    assert (setup.micro_batch, setup.grad_accum, setup.device_index, setup.num_workers) \
        == (8, 2, 0, 0)
    assert setup.prefetch_factor is None and setup.without_cache
    assert RunSetup.from_dict(None) == RunSetup()


@pytest.mark.parametrize("setup, text", [
    ({"micro_batch": 0}, "setup micro_batch: must be an integer >= 1 (got 0)"),
    ({"grad_accum": True}, "setup grad_accum: must be an integer >= 1 (got True)"),
    ({"num_workers": -1}, "setup num_workers: must be an integer >= 0 (got -1)"),
    ({"batch_bytes": 1.5}, "setup batch_bytes: must be an integer >= 0 (got 1.5)"),
])
def test_a_malformed_setup_is_a_value_error_naming_the_key(setup, text):
    # a ValueError: the coordinator counts the report as malformed and ignores it
    with pytest.raises(ValueError) as err:
        RunSetup.from_dict(setup)
    assert str(err.value).startswith(text + "; report ")
