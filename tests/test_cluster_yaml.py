"""cluster.yaml: valid for Ray's own cluster launcher, and set up the way the guard needs."""

from __future__ import annotations

import copy
import pathlib
import re

import pytest

yaml = pytest.importorskip("yaml")
CLUSTER_YAML = pathlib.Path(__file__).resolve().parents[1] / "cluster.yaml"


@pytest.fixture(scope="module")
def cfg() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _ray_validators():
    """Ray's schema check (what `ray up` runs), behind a feature check: private API."""
    pytest.importorskip("jsonschema")
    util = pytest.importorskip("ray.autoscaler._private.util")
    if not (hasattr(util, "validate_config") and hasattr(util, "prepare_config")):
        pytest.skip("this Ray has no validate_config/prepare_config")
    return util.validate_config, util.prepare_config


def test_validates_against_rays_autoscaler_schema(cfg):
    validate_config, prepare_config = _ray_validators()
    validate_config(prepare_config(copy.deepcopy(cfg)))


def test_the_schema_check_is_live(cfg):
    """A broken copy is rejected, so the test above can fail."""
    import jsonschema
    validate_config, prepare_config = _ray_validators()
    broken = copy.deepcopy(cfg)
    broken["available_node_types"]["ray.head.default"]["no_such_field"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def test_has_a_gpu_worker_type(cfg):
    types = cfg["available_node_types"]
    gpu = [name for name, t in types.items() if name != cfg["head_node_type"]
           and re.match(r"(g5|g6|p4d|p4de|p5|p5e)\.", t["node_config"]["InstanceType"])]
    assert gpu, "no worker type with a GPU instance type"


def test_installs_torch_before_the_package(cfg):
    cmds = cfg["setup_commands"]
    torch_at = next(i for i, c in enumerate(cmds) if re.search(r"install \"?torch", c))
    pkg_at = next(i for i, c in enumerate(cmds) if "raytrain_guard" in c)
    assert torch_at < pkg_at
    assert "ray[default,train]" in cmds[pkg_at]          # dashboard, jobs and metrics export


def test_dashboard_on_localhost_and_metrics_port_on_every_node(cfg):
    head = " ".join(cfg["head_start_ray_commands"])
    worker = " ".join(cfg["worker_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head
    assert "0.0.0.0" not in head
    for cmd in (head, worker):
        assert re.search(r"--metrics-export-port=\d+", cmd)
