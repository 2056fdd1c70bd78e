"""GuardConfig: seed-rule defaults, validation naming the field and the fix, TOML loading."""

import os
import pickle

import pytest

from raytrain_guard import ConfigError, GuardConfig, InputError


def test_defaults_are_the_seed_rules():
    c = GuardConfig()
    assert c.headroom_frac == 0.15 and c.budget_frac == pytest.approx(0.85)
    assert c.host_prefetch_frac == 0.05
    assert (c.memory_watermark_frac, c.memory_critical_frac) == (0.88, 0.90)
    assert c.num_slow_steps == 3
    assert (c.min_workers_per_gpu, c.max_workers_per_gpu) == (2, 8)
    assert c.pacing_enabled is False


def test_every_field_is_documented():
    import dataclasses
    for f in dataclasses.fields(GuardConfig):
        assert len(f.metadata.get("doc", "")) > 20, f.name


@pytest.mark.parametrize("changes, field, fix", [
    ({"headroom_frac": 1.5}, "headroom_frac", "choose headroom_frac in [0.0, 0.9]"),
    ({"headroom_frac": -0.1}, "headroom_frac", "choose headroom_frac in [0.0, 0.9]"),
    ({"num_slow_steps": 0}, "num_slow_steps", "choose num_slow_steps >= 1"),
    ({"num_slow_steps": 2.5}, "num_slow_steps", "set num_slow_steps to an integer"),
    ({"host_prefetch_frac": 0.0}, "host_prefetch_frac", "choose host_prefetch_frac in (0.0, 0.5]"),
    ({"memory_watermark_frac": 0.95}, "memory_watermark_frac", "memory_critical_frac=0.9"),
    ({"min_workers_per_gpu": 9}, "min_workers_per_gpu", "max_workers_per_gpu=8"),
    ({"pacing_enabled": "yes"}, "pacing_enabled", "true or false"),
    ({"headroom_frac": "0.1"}, "headroom_frac", "a number"),
])
def test_bad_values_name_the_field_and_the_fix(changes, field, fix):
    with pytest.raises(ConfigError) as err:
        GuardConfig(**changes)
    assert err.value.field == field
    assert fix in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_key_suggests_the_closest_name():
    with pytest.raises(ConfigError, match="did you mean 'headroom_frac'"):
        GuardConfig.from_dict({"headrom_frac": 0.2})


def test_toml_top_level_and_table(tmp_path):
    flat = tmp_path / "flat.toml"
    flat.write_text("headroom_frac = 0.2\nnum_slow_steps = 5\n")
    assert GuardConfig.from_toml(flat) == GuardConfig(headroom_frac=0.2, num_slow_steps=5)
    table = tmp_path / "table.toml"
    table.write_text("[raytrain_guard]\nmemory_watermark_frac = 0.8\n")
    assert GuardConfig.from_toml(table).memory_watermark_frac == 0.8


@pytest.mark.parametrize("text, match", [
    ("headroom_frac = 3\n", "headroom_frac: must be <= 0.9"),
    ("bogus = 1\n", "bogus: unknown key"),
    ("headroom_frac = \n", "not valid TOML"),
])
def test_toml_errors(tmp_path, text, match):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        GuardConfig.from_toml(p)


def test_missing_toml_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        GuardConfig.from_toml(tmp_path / "nope.toml")


def test_replace_validates_again():
    with pytest.raises(ConfigError):
        GuardConfig().replace(num_slow_steps=-1)


def test_errors_survive_pickling():
    err = ConfigError("headroom_frac", "must be <= 0.9", value=2, fix="choose less")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, InputError) and str(back) == str(err) and back.field == "headroom_frac"


@pytest.mark.parametrize("content, match", [
    (None, r"config: cannot read it: is a directory \(got '.*'\); pass the path of a TOML file"),
    (b"headroom_frac = 0.2  # \xe9t\xe9\n", r"config: not UTF-8 .*; save the file as UTF-8"),
])
def test_unreadable_toml_file(tmp_path, content, match):
    p = tmp_path / "c.toml"
    if content is None:
        p.mkdir()
    else:
        p.write_bytes(content)
    with pytest.raises(ConfigError, match=match) as err:
        GuardConfig.from_toml(p)
    assert str(p) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root reads a file without read permission")
def test_toml_file_without_permission(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("headroom_frac = 0.2\n")
    p.chmod(0)
    with pytest.raises(ConfigError, match="cannot read it: permission denied"):
        GuardConfig.from_toml(p)


def test_toml_value_errors_name_the_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[raytrain_guard]\nnum_slow_steps = 2.5\n")
    with pytest.raises(ConfigError) as err:
        GuardConfig.from_toml(p)
    assert err.value.field == f"{p}: num_slow_steps"
    assert "must be an integer (got 2.5)" in str(err.value)


def test_toml_dashed_table_points_to_the_underscore(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[raytrain-guard]\nheadroom_frac = 0.2\n")
    with pytest.raises(ConfigError) as err:
        GuardConfig.from_toml(p)
    assert err.value.field == f"{p}: [raytrain-guard]"
    assert "write the table as [raytrain_guard]" in str(err.value)
    assert "known keys" not in str(err.value)


def test_toml_top_level_keys_next_to_the_table_are_refused(tmp_path):
    # keys above the table header would be dropped: refused, not silently ignored
    p = tmp_path / "c.toml"
    p.write_text("headroom_frac = 0.2\n[raytrain_guard]\nnum_slow_steps = 4\n")
    with pytest.raises(ConfigError, match="headroom_frac: top-level key next to a "
                                          r"\[raytrain_guard\] table"):
        GuardConfig.from_toml(p)
    # other tables (another tool's section of a shared file) stay allowed next to it
    shared = tmp_path / "shared.toml"
    shared.write_text("[other_tool]\nx = 1\n[raytrain_guard]\nnum_slow_steps = 4\n")
    assert GuardConfig.from_toml(shared).num_slow_steps == 4


def test_optional_field_says_how_to_write_none(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('slow_step_abs_s = "none"\n')
    with pytest.raises(ConfigError, match="leave slow_step_abs_s out for none"):
        GuardConfig.from_toml(p)
    with pytest.raises(ConfigError, match=r"out for none \(None in Python\)"):
        GuardConfig(slow_step_abs_s="none")
    p.write_text("slow_step_abs_s = 2.5\n")
    assert GuardConfig.from_toml(p).slow_step_abs_s == 2.5
    assert GuardConfig.from_toml(tmp_path / "c.toml").cpu_memory_budget_bytes is None
