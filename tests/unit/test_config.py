"""Runs in the test process: configuration decoding and validation, no daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.config import ConfigError, load_config, parse_size


def test_defaults_need_no_file() -> None:
    cfg = load_config(None, {}, env={"XDG_RUNTIME_DIR": "/run/user/5"})
    assert cfg.runtime_dir == "/run/user/5/kvd"
    assert cfg.max_total_bytes > 0 and cfg.lease_ms == 10_000 and cfg.policy == "adaptive"
    cfg = load_config(None, {}, env={})
    assert cfg.runtime_dir.startswith("/tmp/kvd-")


def test_file_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "kvd.toml"
    f.write_text('lease_ms = 2000\nmax_total_bytes = "2GiB"\npolicy = "arc"\n')
    cfg = load_config(f, {"lease_ms": "3000", "policy": None})
    assert (cfg.lease_ms, cfg.max_total_bytes, cfg.policy) == (3000, 2 << 30, "arc")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"lease_ms": "0"}, "lease_ms"),
        ({"log_level": "loud"}, "log_level"),
        ({"max_total_bytes": "lots"}, "max_total_bytes"),
        ({"pin_cap_fraction": "2"}, "pin_cap_fraction"),
    ],
)
def test_bad_values_name_the_key(overrides: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_sizes() -> None:
    assert parse_size("1048576") == 1 << 20
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("64G") == 64 << 30
    with pytest.raises(ValueError):
        parse_size("12 parsecs")


def test_deploy_example_is_valid_and_names_every_key() -> None:
    import re
    import tomllib

    from kvd.config import Config

    example = Path(__file__).parents[2] / "deploy" / "kvd.toml"
    text = example.read_text()
    cfg = load_config(example, {})
    assert cfg.group == "kvd" and cfg.runtime_dir == "/run/kvd"
    top = set(tomllib.loads(text))
    assert top | {"pools"} == set(Config.__struct_fields__)
    pool_keys = set(re.findall(r"^# (\w+) = ", text, re.MULTILINE))
    from kvd.config import PoolConfig

    assert set(PoolConfig.__struct_fields__) <= pool_keys
