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


def test_a_node_fault_names_a_node_and_takes_its_ranks_where_they_run():
    f = parse_fault("slow_compute:node=1,start=4,stop=9,factor=3", num_nodes=2)
    assert (f.kind, f.node, f.ranks, f.start, f.stop) == ("slow_compute", 1, (), 4, 9)
    assert FaultSpec.from_dict(f.to_dict()) == f and parse_fault(str(f)) == f
    assert str(f) == "slow_compute:node=1,start=4,stop=9,factor=3.0"
    # its ranks are known where they run: on node 1, any rank; elsewhere, none
    assert f.on(0, node_index=1) and f.on(3, node_index=1)
    assert not f.on(1, node_index=0) and not f.on(1)
    assert f.on_ranks([3, 2, 3]).ranks == (2, 3) and f.on_ranks([3]).node == 1
    assert parse_fault("host_memory:node=0,start=2,size=1MiB").node == 0
    assert parse_fault("comm_delay:node=0,start=2,seconds=0.01").node == 0
    assert parse_fault("comm_delay:rank=0,start=2,seconds=0.01").node is None


@pytest.mark.parametrize("spec, names, fix", [
    ("slow_compute:node=2,start=4,factor=3", "node 2 is not below --nodes 2", "--nodes 3"),
    ("slow_compute:node=1,rank=1,start=4,factor=3", "node and rank(s) together", "not both"),
    ("comm_delay:node=1,ranks=0+1,start=4,seconds=0.01", "node and rank(s) together",
     "node=K for every rank of node K"),
    ("crash:node=1,start=4", "takes no node key", "crash:rank=1"),
    ("slow_compute:node=-1,start=4,factor=3", "node=-1 is not valid", "e.g."),
    ("host_memory:node=1,size=1MiB", "missing start", "host_memory:node=1,start="),
    ("host_memory:node=1,start=4", "holds nothing", "frac=F"),
    ("host_memory:node=1,start=4,frac=1.5", "frac=1.5 is not valid", "e.g."),
])
def test_a_bad_node_key_is_one_line_naming_fault_and_the_fix(spec, names, fix):
    with pytest.raises(InputError) as err:
        parse_fault(spec, world_size=2, num_nodes=2)
    assert names in err.value.problem and fix in err.value.fix, str(err.value)
    assert err.value.field == "--fault" and "\n" not in str(err.value)
