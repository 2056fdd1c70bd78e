"""The pure core imports only the standard library: every raytrain_guard.core module, the
planner's capacity math and raytrain_guard.config import in a fresh interpreter where ray,
torch, pynvml, psutil and numpy cannot be imported. The planner's torch adapters (tracing a
model, inspecting batches, FSDP units) are the exception, named in ADAPTERS."""

import json
import subprocess
import sys

BLOCKED = ("ray", "torch", "pynvml", "psutil", "numpy")
ADAPTERS = ("trace", "batch_inspect", "batches", "fsdp_units")

SCRIPT = r"""
import importlib, json, pkgutil, sys

BLOCKED, ADAPTERS = %r

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked in the pure core: {name}")
        return None

sys.meta_path.insert(0, Block())
import raytrain_guard.config
import raytrain_guard.core as core
import raytrain_guard.planner as planner
names = ["raytrain_guard.config"]
for package in (core, planner):
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if package is planner and info.name.rsplit(".", 1)[1] in ADAPTERS:
            continue
        importlib.import_module(info.name)
        names.append(info.name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps({"modules": names, "leaked": leaked}))
"""


def test_core_imports_only_the_standard_library():
    out = subprocess.run([sys.executable, "-c", SCRIPT % ((BLOCKED, ADAPTERS),)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr      # an ImportError names the offending module
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["leaked"] == []
    # the planner's modules are among those checked (the walk found the package)
    assert {"raytrain_guard.planner.plan", "raytrain_guard.planner.buckets",
            "raytrain_guard.planner.dataloader_sizing",
            "raytrain_guard.planner.memory_model"} <= set(result["modules"])


def test_the_blocker_bites():
    # The same script fails when anything it imports pulls in a blocked package: here the
    # script itself imports torch where it would import the config.
    script = SCRIPT.replace("import raytrain_guard.config", "import json as _j; import torch")
    out = subprocess.run([sys.executable, "-c", script % ((BLOCKED, ADAPTERS),)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "blocked in the pure core: torch" in out.stderr
