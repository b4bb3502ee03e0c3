"""Runs in the daemon and the CLI: the configuration, one frozen object built once.

Sources, later ones winning: built-in defaults, the TOML file (`--config`, or
`/etc/kvd/kvd.toml` when present), command-line flags. Every key has a flag of
the same name (`lease_ms` -> `--lease-ms`). Decoding and validation are
msgspec's; a bad value becomes one `ConfigError` line naming the key.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote

import msgspec

from kvd_client.paths import ADMIN_TOKEN_FILE, default_runtime_dir
from kvd_client.protocol import MAX_NAME_CHARS, POOL_NAME_PATTERN

DEFAULT_CONFIG_PATH = Path("/etc/kvd/kvd.toml")
GiB = 1 << 30

Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
PoolName = Annotated[str, msgspec.Meta(pattern=POOL_NAME_PATTERN, max_length=MAX_NAME_CHARS)]
PolicyName = Literal["lru", "arc", "adaptive"]


class ConfigError(Exception):
    """A configuration that cannot run; the message is one line naming the key."""


class RemoteTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Where the remote tier is, as `remote_url` says (`parse_remote_url`)."""

    cluster: bool
    nodes: list[tuple[str, int]]
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False


_REMOTE_SCHEMES = {
    "redis": (False, False),
    "rediss": (False, True),
    "redis+cluster": (True, False),
    "rediss+cluster": (True, True),
}


def redact_url(url: str) -> str:
    """`url` with its credentials (whatever comes before its last `@`, after the
    scheme if it has one) replaced by ***, for messages: also a value with no
    `://`, such as `user:password@host:port`."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    _, at, hosts = rest.rpartition("@")
    return f"{scheme}{sep}***@{hosts}" if at else url


# Userinfo in free text: a run up to the last `@` of a word, after an optional
# `key=` and scheme, e.g. `default:pw@host`, `redis://u:pw@h`, `url=u:pw@h`.
_USERINFO = re.compile(r"((?:\b\w+=)?(?:[A-Za-z][A-Za-z0-9+.-]*://)?)[^\s'\"<>]+@")


def redact(text: str) -> str:
    """`text` (a message, a log line) with every userinfo-looking part replaced by
    ***: nothing kvd prints or logs shows a credential that a value carried."""
    return _USERINFO.sub(r"\1***@", text) if "@" in text else text


def parse_remote_url(url: str) -> RemoteTarget:
    """`remote_url` -> RemoteTarget; ValueError (saying what is wrong, without the
    URL's credentials) otherwise. Credentials may be percent-encoded."""
    shown = redact_url(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _REMOTE_SCHEMES:
        raise ValueError(
            f"{shown!r}: use redis://host:port[/db], rediss://..., or "
            "redis+cluster://host:port[,host:port...]"
        )
    cluster, tls = _REMOTE_SCHEMES[scheme]
    creds, at, hosts = rest.rpartition("@")
    if not at:
        creds, hosts = "", rest
    hosts, slash, db_text = hosts.partition("/")
    username = password = None
    if creds:
        user, colon, secret = creds.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    db = 0
    if slash and db_text:
        if not db_text.isdigit():
            raise ValueError(f"{shown!r}: database {db_text!r} is not a number")
        db = int(db_text)
        if cluster and db:
            raise ValueError(f"{shown!r}: a cluster has database 0 only")
    nodes = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon:
            host, port = part.strip(), "6379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{shown!r}: {part!r} is not host:port")
        nodes.append((host, int(port)))
    if not cluster and len(nodes) != 1:
        raise ValueError(f"{shown!r}: redis:// names one server; use redis+cluster:// for more")
    return RemoteTarget(cluster=cluster, nodes=nodes, db=db, username=username,
                        password=password, tls=tls)  # fmt: skip


class PoolConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A pool declared up front; engines attach to it with an equal layout."""

    name: PoolName
    model: str
    dtype: str
    block_tokens: Positive
    world_size: Positive
    replicated: bool = False
    slot_bytes: Positive
    extra: str = ""
    capacity_bytes: Positive
    policy: PolicyName | None = None
    disk_bytes: NonNegative | None = None  # this pool's slab (SPEC 16); None = its share


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    runtime_dir: str = ""  # "" = $XDG_RUNTIME_DIR/kvd or /tmp/kvd-<uid>
    group: str = ""  # service group for sockets and segments; "" = owner only
    lease_ms: Positive = 10_000
    job_timeout_ms: Positive = 30_000
    shutdown_timeout_ms: Positive = 5_000
    max_total_bytes: NonNegative = 0  # 0 = a quarter of physical RAM
    default_pool_bytes: Positive = 4 * GiB  # when an Attach names no capacity
    policy: PolicyName = "adaptive"
    pin_cap_fraction: Fraction = 0.5  # of a pool's blocks, per session
    max_sessions: Positive = 4096
    # Job results a scheduler has not collected (`finished()`); the oldest go past it.
    max_pending_results: Positive = 65_536
    prefault: bool = True
    ready_tables: bool = True  # publish each pool's ready set in shared memory (SPEC 15)
    # "warm": a start adopts the pools an earlier run left in this runtime dir,
    # and a shutdown keeps them (SPEC 13); "cold": both unlink them.
    restart: Literal["warm", "cold"] = "warm"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # KV events in vLLM's wire format. "" = ipc://<runtime_dir>/events.sock
    # (replay.sock); "none" disables; tcp://host:port binds TCP as well.
    events_endpoint: str = ""
    replay_endpoint: str = ""
    events_topic: str = "kv@{hostname}@{pool}"
    events_int_hashes: bool = True  # 8-byte keys published as the ints engines sent
    # "map": vLLM 0.32's tagged-map events; "array": the older positional form
    # (llm-d's kv-cache indexer reads only that one).
    events_format: Literal["map", "array"] = "map"
    events_buffer: NonNegative = 10_000  # batches kept for replay
    events_buffer_bytes: Positive = 64 << 20  # ... and at most this many bytes of them
    metrics_addr: str = "127.0.0.1:9464"  # Prometheus /metrics; "none" disables
    # The remote tier (SPEC 14): redis://host:port[/db], rediss://... (TLS), or
    # redis+cluster://host:port[,host:port...] (rediss+cluster:// with TLS);
    # "" = none. Pools with equal layouts share blocks through it across hosts.
    remote_url: str = ""
    remote_timeout_ms: Positive = 500  # one remote call; a lookup waits at most this
    remote_write_max_bytes: Positive = 64 << 20  # write-behind bytes in flight; past it, skipped
    remote_fetch_max_bytes: Positive = 256 << 20  # bytes one lookup's fetch brings in
    remote_miss_ms: NonNegative = 2_000  # a block the remote lacked is not asked for again
    remote_ttl_s: NonNegative = 0  # expiry of written blocks; 0 = the store's own policy
    remote_prefix: str = "kvd"  # first part of every remote key
    # The disk tier (SPEC 16): one slab file per pool in disk_dir; "" = none.
    disk_dir: str = ""
    disk_bytes: NonNegative = 0  # all slabs together; 0 = half the filesystem's free space
    disk_write_max_bytes: Positive = 256 << 20  # write-behind bytes in flight; past it, skipped
    disk_queue_depth: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16  # I/O threads
    disk_timeout_ms: Positive = 2_000  # a lookup waits at most this for a disk read
    disk_admit: Literal["always", "second"] = "always"  # "second": the 2nd store of a block
    pools: list[PoolConfig] = []

    @property
    def runtime_path(self) -> Path:
        return Path(self.runtime_dir)

    @property
    def control_socket(self) -> Path:
        return self.runtime_path / "control.sock"

    @property
    def admin_token_file(self) -> Path:
        return self.runtime_path / ADMIN_TOKEN_FILE


# Keys that take a flag (all but the pool table).
FLAG_KEYS = [name for name in Config.__struct_fields__ if name != "pools"]
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: str) -> int:
    """'64GiB', '512M', '1048576' -> bytes; raises ValueError for anything else."""
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"not a size: {value!r} (use e.g. 1048576, 512MiB, 64GiB)")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * _UNITS[unit])


def _normalize_sizes(data: dict[str, Any], where: str = "") -> None:
    for key, value in data.items():
        if key.endswith("_bytes") and isinstance(value, str):
            try:
                data[key] = parse_size(value)
            except ValueError as exc:
                raise ConfigError(f"bad config value for {where}{key}: {exc}") from None


def _physical_ram() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * GiB


def load_config(
    path: Path | None,
    overrides: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
) -> Config:
    """Builds the config: defaults, then the file, then the flag overrides."""
    data: dict[str, Any] = {}
    if path is None and DEFAULT_CONFIG_PATH.is_file():
        path = DEFAULT_CONFIG_PATH
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    _normalize_sizes(data)
    for i, pool in enumerate(data.get("pools", []) or []):
        if isinstance(pool, dict):
            _normalize_sizes(pool, f"pools[{i}].")
    try:
        config = msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bad config value: {_readable(str(exc))}") from None
    changes: dict[str, Any] = {}
    runtime = config.runtime_dir or str(default_runtime_dir(env))
    if not config.runtime_dir:
        changes["runtime_dir"] = runtime
    for key, sock in (("events_endpoint", "events.sock"), ("replay_endpoint", "replay.sock")):
        value = getattr(config, key)
        if not value:
            changes[key] = f"ipc://{Path(runtime) / sock}"
        elif value == "none":
            changes[key] = ""
        elif not value.startswith(("ipc://", "tcp://")):
            raise ConfigError(f"bad config value: {key}: {value!r} is not ipc://... or tcp://...")
    if config.metrics_addr == "none":
        changes["metrics_addr"] = ""
    if config.remote_url:
        try:
            parse_remote_url(config.remote_url)
        except ValueError as exc:
            raise ConfigError(f"bad config value: remote_url: {exc}") from None
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", config.remote_prefix):
            raise ConfigError(
                "bad config value: remote_prefix: 1 to 64 letters, digits, '.', '-' or '_'"
            )
    if config.disk_dir and not Path(config.disk_dir).is_absolute():
        changes["disk_dir"] = str(Path(config.disk_dir).resolve())
    if "{pool}" not in config.events_topic:
        raise ConfigError("bad config value: events_topic: must contain {pool}")
    if config.max_total_bytes == 0:
        changes["max_total_bytes"] = _physical_ram() // 4
    names = [p.name for p in config.pools]
    if len(set(names)) != len(names):
        raise ConfigError("bad config value: pools: pool names must be unique")
    return msgspec.structs.replace(config, **changes) if changes else config


def _readable(message: str) -> str:
    # msgspec says "Expected `int` >= 1 - at `$.lease_ms`"; lead with the key.
    m = re.match(r"^(.*) - at `\$\.?(.*)`$", message)
    if m:
        return f"{m.group(2) or '(top level)'}: {m.group(1)}"
    return message
