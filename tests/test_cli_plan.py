"""`raytrain-guard plan`: exit codes 0/1/2, --json keys, count parsing, and a one-line error
without a traceback for every kind of bad input.

``run_plan`` calls the CLI's entry function in this process (a subprocess per call cost ~2 s of
imports each); the factories below are what it imports (``--model test_cli_plan:...``). Three
tests keep a real subprocess, where the process is the point: ``python -m raytrain_guard.cli``,
the installed console script, and a fresh interpreter that must not import torch or ray.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from raytrain_guard.cli import main

ROOT = Path(__file__).resolve().parents[1]


# -- factories for the subprocesses -----------------------------------------------------------

def raising_model() -> nn.Module:
    raise RuntimeError("cannot build: no weights file")


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if self.lin(x).sum().item() > 0:        # a value, not a shape: no fake/meta run
            return self.lin(x)
        return -self.lin(x)


def data_dependent_model() -> nn.Module:
    return _DataDependent()


def tiny_batch() -> torch.Tensor:
    return torch.randn(4, 8)


def raising_sample():
    raise ValueError("no data on this machine")


class ListDataset(Dataset):
    """Keeps 2000 samples as Python lists: the copy-on-read case."""

    def __init__(self) -> None:
        self.samples = [[float(i)] * 16 for i in range(2000)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return torch.tensor(self.samples[i])


class TensorDataset(Dataset):
    def __init__(self) -> None:
        self.data = torch.zeros(2000, 16)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def list_dataset() -> Dataset:
    return ListDataset()


def tensor_dataset() -> Dataset:
    return TensorDataset()


# -- helpers -----------------------------------------------------------------------------------

def run_plan(*args: str) -> subprocess.CompletedProcess:
    """``raytrain-guard plan ARGS`` in this process: its exit code (argparse's SystemExit too),
    stdout and stderr, where log records at WARNING and above land as the command's own
    ``logging.basicConfig`` would put them. ``sys.path``, the working directory and the root
    logger are restored; torch's default dtype must come back unchanged."""
    stdout, stderr = io.StringIO(), io.StringIO()
    # under pytest the root logger has handlers, so the CLI's basicConfig adds none: give the
    # records this run's stderr, in the CLI's format
    handler = logging.StreamHandler(stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    saved_path, saved_handlers, saved_level = list(sys.path), list(root.handlers), root.level
    dtype = torch.get_default_dtype()
    root.addHandler(handler)
    try:
        with contextlib.chdir(ROOT), contextlib.redirect_stdout(stdout), \
                contextlib.redirect_stderr(stderr):
            try:
                returncode = main(["plan", *args])
            except SystemExit as exit_:
                code = exit_.code
                returncode = code if isinstance(code, int) else (0 if code is None else 1)
                if not isinstance(code, (int, type(None))):
                    print(code, file=sys.stderr)
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        sys.path[:] = saved_path
    assert torch.get_default_dtype() == dtype, "plan left torch's default dtype changed"
    return subprocess.CompletedProcess(["raytrain-guard", "plan", *args], returncode,
                                       stdout.getvalue(), stderr.getvalue())


def one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("raytrain-guard plan: error: ")
    return lines[0]


# 7.5 B parameters in bf16 with plain SGD on one rank: parameters 15 GB, gradients alive early in
# backward 15 GB, no optimizer state: peak 30 GB = 27.9 GiB plus a 1 GiB context and 5 %
# fragmentation -> 30.4 GiB. It fits an 80 GiB card (budget 68 GiB), not a 32 GiB one (27.2 GiB).
SMALL = ("--precision", "bf16", "--optimizer", "sgd")


@pytest.mark.parametrize("count", ["7.5B", "7.5e9", "7500000000"])
def test_params_spellings(count):
    out = run_plan("--params", count, *SMALL, "--gpu-mem", "80GiB", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["num_params"] == 7_500_000_000
    assert d["peak_bytes"] == 30_000_000_000


def test_exit_1_when_it_does_not_fit():
    out = run_plan("--params", "7.5B", *SMALL, "--gpu-mem", "32GiB")
    assert out.returncode == 1, out.stderr
    assert "DOES NOT FIT" in out.stdout and "over the 27.2 GiB budget" in out.stdout


def test_json_keys_and_table():
    out = run_plan("--params", "1B", "--workers", "8", "--gpus-per-node", "8", "--gpu-mem",
                   "80GiB", "--host-mem", "1TiB", "--cpus-per-node", "96", "--batch-bytes",
                   "64MiB", "--global-batch", "256", "--activation-bytes-per-sample", "1GiB",
                   "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)                 # exactly one JSON object on stdout
    for key in ("fits", "device_memory_bytes", "budget_bytes", "peak_bytes", "total_bytes",
                "breakdown", "peak_phase", "max_micro_batch", "grad_accum", "bucket_cap_mb",
                "dataloader", "warnings", "arithmetic"):
        assert key in d, key
    assert d["micro_batch"] * d["grad_accum"] * 8 == 256
    assert d["dataloader"]["num_workers"] == 8 and d["bucket_cap_mb"] > 0
    table = run_plan("--params", "1B", "--workers", "8", "--gpus-per-node", "8", "--gpu-mem",
                     "80GiB", "--host-mem", "1TiB", "--cpus-per-node", "96", "--batch-bytes",
                     "64MiB", "--global-batch", "256", "--activation-bytes-per-sample", "1GiB")
    assert table.returncode == 0
    for word in ("FITS", "micro_batch", "grad_accum", "bucket_cap_mb", "DataLoader",
                 "(85 % of 80.0 GiB)"):
        assert word in table.stdout


def test_params_alone_says_activations_are_unknown():
    d = json.loads(run_plan("--params", "1B", "--gpu-mem", "80GiB", "--json").stdout)
    assert d["breakdown"]["activations"] == 0
    assert any("activations unknown" in w for w in d["warnings"])


def test_transformer_shape():
    out = run_plan("--layers", "32", "--hidden", "4096", "--heads", "32", "--seq-len", "4096",
                   "--vocab", "32000", "--strategy", "fsdp-full", "--precision", "amp-bf16",
                   "--workers", "64", "--gpus-per-node", "8", "--gpu-mem", "80GiB", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["activations_source"] == "analytic" and d["max_micro_batch"] >= 1
    assert 6.5e9 < d["num_params"] < 7e9


def test_traced_model_with_sample():
    out = run_plan("--model", "examples.models:mlp", "--sample", "examples.models:mlp_batch",
                   "--gpu-mem", "80GiB", "--host-mem", "64GiB", "--cpus-per-node", "16",
                   "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["activations_source"] == "traced" and d["max_micro_batch"] > 1
    # the real sample batch was measured and the loader sized within its host budget
    assert d["dataloader"] is not None
    assert 0 < d["dataloader"]["host_bytes"] <= d["dataloader"]["budget_bytes"]


def test_list_backed_dataset_warns():
    out = run_plan("--params", "1B", "--gpu-mem", "80GiB", "--host-mem", "64GiB",
                   "--cpus-per-node", "16", "--micro-batch", "4", "--dataset",
                   "test_cli_plan:list_dataset", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert any("Python lists" in w for w in d["warnings"])
    # 16 float32 per sample = 64 B; micro-batch 4 -> 256 B per batch
    assert d["dataloader"]["host_bytes"] == 256 * 2 * d["dataloader"]["num_workers"] * \
        d["dataloader"]["prefetch_factor"]
    clean = json.loads(run_plan("--params", "1B", "--gpu-mem", "80GiB", "--host-mem", "64GiB",
                                "--cpus-per-node", "16", "--dataset",
                                "test_cli_plan:tensor_dataset", "--json").stdout)
    assert not any("Python lists" in w for w in clean["warnings"])


@pytest.mark.parametrize("args, names", [
    (("--params", "1B", "--gpu-mem", "80XB"), "--gpu-mem: not a size"),
    (("--params", "7.5Q", "--gpu-mem", "80GiB"), "--params: not a count"),
    (("--params", "0", "--gpu-mem", "80GiB"), "--params: must be a positive count"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--workers", "0"),
     "--workers: must be an integer >= 1 (got '0'); pass --workers as a positive integer"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--micro-batch", "-3"), "--micro-batch"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--global-batch", "1.5"),
     "--global-batch: must be an integer >= 1 (got '1.5')"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--strategy", "zero9"), "strategy: unknown value"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--precision", "fp8"), "precision: unknown value"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--headroom", "2"), "headroom_frac"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--config", "no/such.toml"), "file not found"),
    (("--gpu-mem", "80GiB"), "model: give exactly one model source"),
    (("--params", "1B", "--layers", "2", "--gpu-mem", "80GiB"), "got --params and"),
    (("--layers", "2", "--hidden", "64", "--gpu-mem", "80GiB"), "--heads: is required"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--batch-bytes", "10GiB", "--host-mem", "16GiB"),
     "exceeds the host prefetch budget"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--sample", "test_cli_plan:raising_sample"),
     "--sample: the factory raised ValueError: no data on this machine"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--micro-batch", "2", "--grad-accum", "2",
      "--global-batch", "5"), "--global-batch: disagrees"),
    # argparse's own errors: one line, not the usage block
    (("--params", "1B", "--gpu-mem", "80GiB", "--no-such-flag"),
     "unrecognized arguments: --no-such-flag"),
    (("--params", "-7B", "--gpu-mem", "80GiB"), ("argument --params: expected one argument "
     "(got '-7B', which reads as an option): --params takes a positive value, e.g. --params 7B")),
    (("--params", "1B", "--gpu-mem", "-80GiB"), "write --gpu-mem=-80GiB to pass"),
    (("--params=-7B", "--gpu-mem", "80GiB"), "--params: must be a positive count (got '-7B')"),
    (("--params", "1B", "--gpu-mem=-80GiB"), "--gpu-mem: must be a positive size"),
    # implausible sizes: 80 without a unit is 80 bytes; 1e40 parameters is no model
    (("--params", "1B", "--gpu-mem", "80"), ("--gpu-mem: no unit, so 80 bytes (got '80'); "
     "write a unit, e.g. 80GiB")),
    (("--params", "1B", "--gpu-mem", "80GiB", "--host-mem", "512"), "--host-mem: no unit"),
    (("--params", "1e40", "--gpu-mem", "80GiB"), "--params: above 1e+15"),
    (("--params", "1B", "--gpu-mem", "1e40"), "--gpu-mem: above 1024.0 TiB"),
    # shape-only options with a parameter count or a traced model are refused, not ignored
    (("--params", "1B", "--gpu-mem", "80GiB", "--recompute", "full"),
     "--recompute: only applies with the model shape"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--attention", "flash"),
     "--attention: only applies with the model shape"),
    (("--model", "examples.models:mlp", "--sample", "examples.models:mlp_batch", "--gpu-mem",
      "80GiB", "--recompute", "selective"), "--recompute: only applies with the model shape"),
    # the planner's fields are named as the flags that set them
    (("--params", "1B", "--gpu-mem", "80GiB", "--host-mem", "1KiB", "--batch-bytes", "1MiB"),
     "--batch-bytes: one batch and its pinned copy"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--host-mem", "1KiB", "--batch-bytes", "1MiB"),
     "or --no-pin-memory"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--headroom", "95%"),
     "--headroom: must be <= 0.9 (got '95%'); choose headroom_frac in [0.0, 0.9]"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--fragmentation", "2"),
     "--fragmentation: must be <= 1.0 (got '2'); choose fragmentation_frac in [0.0, 1.0]"),
    (("--params", "1B", "--gpu-mem", "80GiB", "--fragmentation", "x"),
     "--fragmentation: not a fraction (got 'x'); write 0.14 or 14%"),
    (("--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "8", "--vocab", "10",
      "--gpu-mem", "1GiB", "--norm", "batchnorm"),
     "--norm: unknown value (got 'batchnorm'); choose one of: layernorm, rmsnorm"),
])
def test_bad_input_is_one_line(args, names):
    line = one_line_error(run_plan(*args))
    assert names in line


def test_help_is_still_the_full_usage():
    out = run_plan("--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: raytrain-guard plan")
    assert "--gpu-mem SIZE" in out.stdout and out.stderr == ""


def test_size_without_a_unit_stays_bytes_when_large():
    # 85899345920 bytes is 80 GiB: a bare byte count of a plausible size is kept
    out = run_plan("--params", "1B", "--gpu-mem", "85899345920", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["device_memory_bytes"] == 80 * 1024**3


# 2 layers, h 256, 4 heads, seq 512, vocab 1000, fp32 (e = r = 4), LayerNorm, flash, f 1024,
# micro-batch 1 (t = 512, t h = 131072). One layer without recompute: norms 2*4*131072 =
# 1048576; attention input, Q, projection input (= SDPA output), MLP input 4*4*131072 =
# 2097152; K, V 1048576; MLP 2*4*512*1024 = 4194304; lse 4*4*512 = 8192 -> 8396800.
# Outside: final norm + head input 2*4*131072 = 1048576; loss 12*512*1000 = 6144000.
RECOMPUTE_BYTES = [
    ("none", 2 * 8396800 + 1048576 + 6144000),
    ("selective", 2 * 8396800 + 1048576 + 6144000),   # flash: nothing seq x seq to drop
    # each block keeps its input 524288; then max(loss, one rebuilt block 8396800); at the
    # rebuilt block's moment the head's fp32 gradient 1000 * 256 * 4 exists
    ("full", 2 * 524288 + 1048576 + 8396800 + 1000 * 256 * 4),
    # per-op: input 524288 + matmuls Q, V, fc1 4*512*(256+256+1024) = 3145728 + SDPA 532480
    # = 4202496 a block; a rebuilt block 8396800 - SDPA 532480 - fc1 output 2097152 =
    # 5767168 is below the loss 6144000
    ("per-op", 2 * 4202496 + 1048576 + 6144000),
]


@pytest.mark.parametrize("recompute,activation_bytes", RECOMPUTE_BYTES)
def test_recompute_modes_reach_the_plan(recompute, activation_bytes):
    shape = ("--layers", "2", "--hidden", "256", "--heads", "4", "--seq-len", "512", "--vocab",
             "1000", "--gpu-mem", "80GiB", "--micro-batch", "1", "--json")
    d = json.loads(run_plan(*shape, "--recompute", recompute).stdout)
    none = json.loads(run_plan(*shape).stdout)
    # the backward phase differs by the activations alone (full recompute moves the peak to
    # the optimizer step, so compare the phase, not the breakdown at the peak)
    assert d["phases"]["backward"] - none["phases"]["backward"] == \
        activation_bytes - RECOMPUTE_BYTES[0][1]
    if recompute == "per-op":   # the save policy is stated in the plan
        assert any("per-op SAC" in n and "1st, 3rd" in n for n in d["notes"])


def test_llama_flags_shape_the_plan():
    # Llama-style: no biases -> RMSNorm, GQA expanded unless --no-expand-kv
    shape = ("--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
             "--ffn-hidden", "512", "--gated-mlp", "--no-bias", "--seq-len", "512", "--vocab",
             "1000", "--precision", "bf16", "--gpu-mem", "80GiB", "--micro-batch", "1",
             "--json")
    wide = json.loads(run_plan(*shape).stdout)
    narrow = json.loads(run_plan(*shape, "--no-expand-kv").stdout)
    # K and V at width 128 instead of 256: 2 layers x 2 tensors x 2 bytes x 512 x 128 less
    assert wide["breakdown"]["activations"] - narrow["breakdown"]["activations"] == \
        2 * 2 * 2 * 512 * 128
    layer = json.loads(run_plan(*shape, "--norm", "layernorm").stdout)
    # LayerNorm saves its bf16 input (2 bytes) where RMSNorm saves an fp32 copy and the
    # normalised tensor (6 bytes): 4 bytes x t h x (2 norms x 2 layers + the final norm)
    assert wide["breakdown"]["activations"] - layer["breakdown"]["activations"] == \
        4 * 512 * 256 * 5
    # biases gone: 2 x (256 + 2*128 + 256 + 2*512 + 256 (+ norm biases 2*256)) + final 256
    assert wide["num_params"] == layer["num_params"]


@pytest.mark.parametrize("name, content, words", [
    ("dir", None, "cannot read it: is a directory"),
    ("latin1.toml", b"headroom_frac = 0.2  # \xe9t\xe9\n", "not UTF-8"),
    ("broken.toml", b"headroom_frac = \n", "not valid TOML"),
    ("dash.toml", b"[raytrain-guard]\nheadroom_frac = 0.2\n",
     "write the table as [raytrain_guard]"),
    ("mixed.toml", b"headroom_frac = 0.2\n[raytrain_guard]\nnum_slow_steps = 4\n",
     "headroom_frac: top-level key next to a [raytrain_guard] table"),
    ("range.toml", b"headroom_frac = 3\n", "range.toml: headroom_frac: must be <= 0.9"),
    ("none.toml", b"slow_step_abs_s = \"none\"\n", "leave slow_step_abs_s out for none"),
])
def test_config_file_errors_are_one_line(tmp_path, name, content, words):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    line = one_line_error(run_plan("--params", "1B", "--gpu-mem", "80GiB", "--config", str(path)))
    assert words in line and str(path) in line


def test_world_size_one_recommends_no_buckets():
    # one rank: Ray's prepare_model does not wrap DDP, so there are no gradient buckets to size
    # and no bucket warning, even when the plan does not fit (7.5 B fp32 AdamW: 147.7 GiB)
    out = run_plan("--params", "7.5B", "--gpu-mem", "80GiB")
    assert out.returncode == 1, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("bucket_cap_mb"))
    assert row.split(None, 1)[1] == "none (world size 1: Ray's prepare_model does not wrap DDP)"
    assert "buckets)" not in out.stdout and "DDP buckets" not in out.stdout
    d = json.loads(run_plan("--params", "7.5B", "--gpu-mem", "80GiB", "--json").stdout)
    assert d["bucket_cap_mb"] is None and d["bucket"] is None
    assert not any("bucket" in w for w in d["warnings"])
    two = json.loads(run_plan("--params", "1B", "--workers", "2", "--gpu-mem", "80GiB",
                              "--json").stdout)
    assert two["bucket_cap_mb"] > 0 and two["bucket"]["num_buckets"] >= 1


@pytest.mark.parametrize("model, names", [
    ("no_such_module:make", "cannot import module 'no_such_module'"),
    ("test_cli_plan:no_such_factory", "has no attribute"),
    ("test_cli_plan:raising_model", "cannot build: no weights file"),
    ("test_cli_plan:data_dependent_model", "cannot be traced"),
])
def test_bad_model_is_one_line(model, names):
    line = one_line_error(run_plan("--model", model, "--sample", "test_cli_plan:tiny_batch",
                                   "--gpu-mem", "80GiB"))
    assert names in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the card's memory is used")
def test_gpu_mem_is_required_without_cuda():
    line = one_line_error(run_plan("--params", "1B"))
    assert "--gpu-mem: is required: no CUDA device" in line and "80GiB" in line


def test_argparse_errors_exit_2():
    out = run_plan("--params", "1B", "--gpu-mem", "80GiB", "--no-such-flag")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "usage:" not in out.stderr and "raytrain-guard plan --help" in out.stderr


def test_module_entry_point():
    # `python -m raytrain_guard.cli` in its own process: __main__ passes main's code to exit
    out = subprocess.run([sys.executable, "-m", "raytrain_guard.cli", "plan", "--params", "7.5B",
                          *SMALL, "--gpu-mem", "80GiB"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    assert "FITS" in out.stdout and "micro_batch" in out.stdout
    slow = subprocess.run([sys.executable, "-m", "raytrain_guard.cli", "plan", "--params",
                           "7.5B", *SMALL, "--gpu-mem", "32GiB"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert slow.returncode == 1 and "DOES NOT FIT" in slow.stdout, slow.stderr


def test_console_script():
    exe = shutil.which("raytrain-guard")
    if exe is None:
        pytest.skip("package not installed with its console script")
    out = subprocess.run([exe, "plan", "--params", "7.5B", *SMALL, "--gpu-mem", "80GiB"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "FITS" in out.stdout


def test_machine_ram_default_is_the_container_limit(monkeypatch):
    # the cgroup files are the input here (this box has no limit): a 2 GiB container limit on
    # a larger machine must be what `plan` divides, not the machine's RAM
    import raytrain_guard.runtime.host_memory as host_memory
    from raytrain_guard.cli import sources

    monkeypatch.setattr(host_memory, "read_cgroup_memory", lambda: (2 * 1024**3, 1024**3))
    assert sources.machine_memory() == 2 * 1024**3


def test_configuration_doc_is_the_dataclass_metadata():
    # docs/configuration.md is generated from GuardConfig's field docs; a default or rule
    # changed in one place only fails here (regenerate: python docs/generate_configuration.py)
    import dataclasses
    import importlib.util

    from raytrain_guard.config import GuardConfig
    spec = importlib.util.spec_from_file_location("generate_configuration",
                                                  ROOT / "docs" / "generate_configuration.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == generator.markdown()
    for f in dataclasses.fields(GuardConfig):       # every key has a row and a rule
        assert f"| `{f.name}` |" in doc and f.metadata.get("doc")


def test_plan_from_sizes_does_not_import_torch_or_ray():
    # a plan from --params and sizes is arithmetic: it answers in a fraction of a second
    # (torch's import alone took ~2 s of the 2.3 s it used to)
    code = ("import sys; from raytrain_guard.cli import main; "
            "rc = main(['plan', '--params', '7B', '--gpu-mem', '80GiB', '--json']); "
            "heavy = [m for m in ('torch', 'ray') if m in sys.modules]; "
            "print('HEAVY', heavy, file=sys.stderr); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode in (0, 1), out.stderr
    assert "HEAVY []" in out.stderr, out.stderr


def test_fragmentation_flag_sets_the_allocator_reserve():
    # --params 1B, fp32 AdamW on one rank: optimizer-phase peak 4 + 4 + 8 + 4 (foreach temp)
    # = 20 bytes a parameter = 20e9; reserve = CUDA context 1 GiB + 0.14 * 20e9 = 3873741824
    d = json.loads(run_plan("--params", "1B", "--gpu-mem", "80GiB", "--fragmentation", "14%",
                            "--json").stdout)
    assert d["peak_bytes"] == 20_000_000_000
    assert d["breakdown"]["reserve"] == 1024**3 + 2_800_000_000


# -- FSDP: gradient sync, unit size, the grad-op model states ----------------------------------

def test_fsdp_grad_sync_in_json_and_table():
    # the README's 6.7 B Llama-shape plan: with unsharded gradients (25 GiB) only micro-batch 1
    # fits; reduce-scattering every micro-batch keeps them sharded and fits 2 (fewer micro-steps,
    # fewer all-gathers: less communication as well)
    shape = ("--layers", "32", "--hidden", "4096", "--heads", "32", "--seq-len", "4096",
             "--vocab", "32000", "--strategy", "fsdp-full", "--precision", "amp-bf16",
             "--workers", "64", "--gpus-per-node", "8", "--gpu-mem", "80GiB",
             "--global-batch", "1024")
    out = run_plan(*shape, "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["fsdp_grad_sync"] == "every_micro_batch"
    by_mode = {o["fsdp_grad_sync"]: o for o in d["fsdp_grad_sync_options"]}
    assert by_mode["last_micro_batch"]["max_micro_batch"] == 1
    assert by_mode["every_micro_batch"]["max_micro_batch"] == d["micro_batch"] == 2
    asked = json.loads(run_plan(*shape, "--json", "--fsdp-grad-sync", "last_micro_batch").stdout)
    assert (asked["fsdp_grad_sync"], asked["micro_batch"], asked["grad_accum"]) == \
        ("last_micro_batch", 1, 16)
    table = run_plan(*shape).stdout
    assert "every_micro_batch (chosen)" in table and "last_micro_batch (other)" in table


def test_grad_op_books_unsharded_parameters_under_params():
    # ZeRO paper Table 1, P_os+g, 7.5 B parameters on 64 ranks: 16.6 GB of model states.
    # bf16-master under FSDP2: bf16 unsharded 2 x 7.5e9 = 15 GB + fp32 shards of parameters,
    # gradients and Adam's two states (4 + 4 + 8) x 7.5e9 / 64 = 1.875 GB = 16.875 GB (ZeRO's
    # fp16 gradient shard is 2 bytes, not 4: 16.6)
    out = run_plan("--params", "7.5e9", "--strategy", "fsdp-grad-op", "--workers", "64",
                   "--precision", "bf16-master", "--gpu-mem", "80GiB", "--json")
    d = json.loads(out.stdout)
    assert "model states (the ZeRO paper's Table 1): parameters 15.469 GB + gradients " \
           "0.469 GB + optimizer 0.938 GB = 16.875 GB" in d["notes"]
    # no activations: the peak is late in backward, where the unit reducing (the assumed 1/8,
    # 937.5 M) was resharded: params (7.5e9 - 937.5e6) x 2 + shards 4 x 117.1875 M; comm only
    # its 2 fp32 reduce-scatter buffers 2 x 937.5 M x 4
    b, shard, unit = d["breakdown"], 117_187_500, 937_500_000
    assert d["peak_phase"] == "late-backward"
    assert b["params"] == (7_500_000_000 - unit) * 2 + 4 * shard
    assert b["comm"] == 2 * unit * 4
    assert any("FSDP unit size unknown" in w and "1/8" in w for w in d["warnings"])


def test_fsdp_unit_params_flag():
    base = ("--params", "8e9", "--strategy", "fsdp-full", "--workers", "8", "--gpu-mem",
            "80GiB", "--json")
    default = json.loads(run_plan(*base).stdout)
    given = json.loads(run_plan(*base, "--fsdp-unit-params", "250M").stdout)
    assert not any("FSDP unit size unknown" in w for w in given["warnings"])
    # fp32 AdamW, no activations, shards of 1e9: P 4e9 + G 4e9 + O 8e9 = 16e9; late-backward
    # adds 1 gathered unit + 2 reduce-scatter buffers = 3 x unit x 4 B: 3 x 1e9 x 4 with the
    # default 1/8, 3 x 250 M x 4 given
    assert default["phases"]["late-backward"] == 16_000_000_000 + 12_000_000_000
    assert given["phases"]["late-backward"] == 16_000_000_000 + 3_000_000_000
    err = one_line_error(run_plan("--layers", "2", "--hidden", "64", "--heads", "2",
                                  "--seq-len", "16", "--vocab", "100", "--gpu-mem", "80GiB",
                                  "--fsdp-unit-params", "1M"))
    assert "--fsdp-unit-params" in err and "only applies with --params" in err
    err = one_line_error(run_plan(*base, "--fsdp-unit-params", "9e9"))
    assert "--fsdp-unit-params" in err
    err = one_line_error(run_plan(*base, "--fsdp-grad-sync", "sometimes"))
    assert "--fsdp-grad-sync" in err and "every_micro_batch" in err
