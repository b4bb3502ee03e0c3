"""Runs in the operator's shell: the `kvd` command line (parse, build config, run).

`kvd serve` runs the daemon; `ping`, `stats`, `pools` and `pool drop` talk to
a running one over its control socket; `bench` and `demo` come from the
operator tools (`kvd_tools`) when they are installed.
Exit codes: 0 ok, 1 the daemon refused or could not be reached, 2 bad usage
or configuration.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvd.config import FLAG_KEYS, Config, ConfigError, load_config, redact
from kvd.version import __version__

# `kvd demo` and `kvd bench` live in the operator tools, which bring torch; the
# daemon's own distribution does not depend on them.
TOOLS_DIST = "kvd-tools"
TOOL_COMMANDS = ("demo", "bench")


def tools_installed() -> bool:
    """Whether the operator tools (`kvd_tools`) can be imported here."""
    return importlib.util.find_spec("kvd_tools") is not None


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--runtime-dir", help="the daemon's runtime directory")
    g.add_argument("--endpoint", help="the daemon's control endpoint (ipc://...)")
    p.add_argument("--timeout-ms", type=int, default=2000)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvd", description="kvd: host-side KV-cache daemon for LLM inference engines"
    )
    parser.add_argument("--version", action="version", version=f"kvd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument(
        "--config", type=Path, help="TOML file (default /etc/kvd/kvd.toml if present)"
    )
    for key in FLAG_KEYS:
        field_default = getattr(Config(), key)
        serve.add_argument(
            f"--{key.replace('_', '-')}",
            dest=key,
            metavar="VALUE",
            help=f"config key {key} (default: {field_default!r})",
        )

    for name, text in [
        ("ping", "check that the daemon answers"),
        ("stats", "print the daemon's counters and pools"),
        ("pools", "list the pools"),
    ]:
        p = sub.add_parser(name, help=text)
        _add_client_flags(p)
        if name == "stats":
            p.add_argument("--json", action="store_true", help="print JSON")
    pool = sub.add_parser("pool", help="manage pools")
    pool_sub = pool.add_subparsers(dest="pool_command", metavar="ACTION", required=True)
    drop = pool_sub.add_parser("drop", help="drop a pool and free its memory")
    drop.add_argument("name")
    _add_client_flags(drop)

    sub.add_parser("version", help="print the kvd version")
    if tools_installed():
        from kvd_tools.commands import add_commands

        add_commands(sub)
    else:
        for name in TOOL_COMMANDS:  # listed in --help; `main` answers them
            sub.add_parser(name, help=f"needs the operator tools ({TOOLS_DIST})")
    return parser


def _admin(args: argparse.Namespace) -> Any:
    from kvd_client.connection import Connection
    from kvd_client.paths import control_endpoint, default_endpoint

    endpoint = args.endpoint or (
        control_endpoint(args.runtime_dir) if args.runtime_dir else default_endpoint()
    )
    conn = Connection(endpoint, role="admin", timeout_ms=args.timeout_ms, keeper=False)
    conn.connect()
    return conn


def _serve(args: argparse.Namespace) -> int:
    from kvd.logs import setup_logging

    overrides = {k: getattr(args, k) for k in FLAG_KEYS}
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(redact(f"kvd: {exc}"), file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    from kvd.io.server import run

    try:
        return run(config)
    except (ValueError, OSError) as exc:
        print(redact(f"kvd: cannot start: {exc}"), file=sys.stderr)
        return 1


def _client_command(args: argparse.Namespace) -> int:
    from kvd_client import protocol as p
    from kvd_client.errors import KvdError
    from kvd_client.paths import read_admin_token, runtime_dir_of

    try:
        conn = _admin(args)
        try:
            match args.command:
                case "ping":
                    t0 = time.perf_counter()
                    conn.call(p.Heartbeat)
                    rtt = (time.perf_counter() - t0) * 1e6
                    w = conn.welcome
                    print(
                        f"kvd {w.daemon_version} at {conn.endpoint}: ok, "
                        f"session {w.session_id}, rtt {rtt:.0f} us"
                    )
                case "stats":
                    stats = conn.call(p.Stats)
                    if args.json:
                        print(json.dumps(_plain(stats), indent=2))
                    else:
                        print(_stats_table(stats))
                case "pools":
                    print(_pools_table(conn.call(p.Pools).pools))
                case "pool":
                    # The operator token, when this user may read it; without
                    # it the daemon answers with an error that says where it is.
                    runtime = args.runtime_dir or runtime_dir_of(conn.endpoint)
                    token = read_admin_token(runtime) if runtime else ""
                    conn.call(p.DropPool, args.name, token)
                    print(f"pool {args.name} dropped")
        finally:
            conn.close()
    except KvdError as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 1
    return 0


def _plain(x: Any) -> Any:
    """Structs as JSON objects (the wire encodes them as arrays), minus `req_id`."""
    if isinstance(x, msgspec.Struct):
        return {f: _plain(getattr(x, f)) for f in x.__struct_fields__ if f != "req_id"}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _pools_table(pools: list[Any]) -> str:
    rows = [
        "| pool | model | world | repl | policy | blocks | ready | in flight | pinned | free "
        "| held | GiB | on disk |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pi in pools:
        disk = f"{pi.disk_blocks} of {pi.disk_capacity_blocks}" if pi.disk_capacity_blocks else "-"
        rows.append(
            f"| {pi.name} | {pi.layout.model} | {pi.layout.world_size} | "
            f"{'yes' if pi.layout.replicated else 'no'} | {pi.policy} | {pi.num_blocks} | "
            f"{pi.blocks_ready} | "
            f"{pi.blocks_in_flight} | {pi.blocks_pinned} | {pi.blocks_free} | "
            f"{pi.blocks_held} | {pi.capacity_bytes / (1 << 30):.2f} | "
            f"{disk} |"
        )
    return "\n".join(rows) if pools else "no pools"


def _stats_table(s: Any) -> str:
    lines = [
        f"kvd {s.daemon_version}, up {s.uptime_s:.0f} s, {s.sessions} session(s), "
        f"{s.jobs_in_flight} job(s) in flight, {s.lease_expirations} lease expiration(s)",
        f"memory: {s.used_bytes / (1 << 30):.2f} of {s.max_total_bytes / (1 << 30):.2f} GiB",
        "",
        _pools_table(s.pools),
        "",
        "| counter | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in sorted(s.counters.items())]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOL_COMMANDS and not tools_installed():
        print(
            f"kvd: `kvd {argv[0]}` needs kvd's operator tools: "
            f"pip install {TOOLS_DIST} (from a checkout: pip install ./tools)",
            file=sys.stderr,
        )
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    match args.command:
        case "version":
            print(f"kvd {__version__}")
            return 0
        case "serve":
            return _serve(args)
        case "ping" | "stats" | "pools" | "pool":
            return _client_command(args)
        case "demo" | "bench":
            from kvd_tools.commands import run

            return run(args)
        case _:
            parser.error(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
