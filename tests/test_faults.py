"""Fault specs of the experiment: parsing, and the one-line errors for bad specs (pure)."""

import pytest

from raytrain_guard.errors import InputError
from raytrain_guard.experiment.faults import KINDS, FaultSpec, parse_fault


def test_a_spec_parses_with_its_kind_keys_and_window():
    f = parse_fault("slow_compute:rank=1,start=25,factor=2.5")
    assert (f.kind, f.ranks, f.start, f.stop, dict(f.params)) == \
        ("slow_compute", (1,), 25, None, {"factor": 2.5})
    assert f.cause == "compute" and not f.active(24) and f.active(25) and f.active(10_000)


def test_ranks_stop_sizes_and_defaults():
    f = parse_fault("memory_growth:ranks=0+1,start=10,stop=20,per_step=32KiB")
    assert f.ranks == (0, 1) and f.params["per_step"] == 32 * 1024
    assert f.active(19) and not f.active(20)
    assert parse_fault("activation_spike:rank=0,start=3,factor=8").params["steps"] == 1
    assert parse_fault("crash:rank=1,start=4").once


def test_round_trip_through_a_dict():
    f = parse_fault("comm_delay:rank=1,start=5,stop=9,seconds=0.02")
    assert FaultSpec.from_dict(f.to_dict()) == f
    assert parse_fault(str(f)) == f


@pytest.mark.parametrize("spec, names", [
    ("slow:rank=1,start=2", "unknown fault kind 'slow'"),
    ("slow_compute:rank=1,start=2", "slow_compute: missing factor"),
    ("slow_compute:rank=1,start=2,factor=0.5", "factor=0.5 is not valid"),
    ("slow_compute:rank=1,factor=2", "slow_compute: missing start"),
    ("slow_compute:rank=1,start=9,stop=3,factor=2", "stop must be after start"),
    ("slow_compute:rank=1,start=2,factor=2,speed=3", "unknown key 'speed'"),
    ("slow_compute:rank=1,start=2,factor", "'factor' is not key=value"),
    ("crash:rank=a,start=2", "rank must be a whole number"),
    ("crash:rank=1,ranks=0+1,start=2", "both rank and ranks"),
    ("crash:rank=3,start=2", "rank out of range"),
    ("memory_growth:rank=0,start=1,per_step=lots", "per_step=lots is not valid"),
    ("crash:rank=1,start=-2", "crash: start=-2 is not valid (must be an integer >= 0)"),
    ("crash:rank=1,start=2,stop=x", "crash: stop=x is not valid (must be an integer >= 0)"),
    ("activation_spike:rank=0,start=3,factor=8,steps=0",
     "activation_spike: steps=0 is not valid (must be an integer >= 1)"),
])
def test_a_bad_spec_is_one_line_naming_the_kind_or_key_and_the_fix(spec, names):
    with pytest.raises(InputError) as err:
        parse_fault(spec, world_size=2)
    message = str(err.value)
    assert names in message and "\n" not in message
    assert err.value.field == "--fault" and err.value.fix


def test_every_kind_has_an_example_that_parses():
    for kind, spec in KINDS.items():
        assert parse_fault(spec.example).kind == kind
