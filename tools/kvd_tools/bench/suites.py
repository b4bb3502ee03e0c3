"""Runs in the operator's shell: the registry of `kvd bench` suites and their flags.

Adding a suite takes two steps:

1. write a module `tools/kvd_tools/bench/<name>.py` with
   `run(args: argparse.Namespace) -> list[Row]` (rows carry the SPEC section 10
   field names, in column order) and, optionally,
   `summarize(rows: list[Row]) -> list[str]` (lines printed under the table);
2. add `"<name>": Suite("kvd_tools.bench.<name>", help, add_arguments, quick)`
   to `SUITES`, where `quick` holds the flag values of its `--quick` form
   (SPEC section 10: seconds, small sizes; `make test` runs it, see
   `tests/integration/test_bench_quick.py`).

`--quick` is one flag of every suite, handled here: a suite's `run()` sees
the `quick` values in place of its defaults, and knows nothing of it. A
flag given on the command line wins over both (`kvd bench rpc --quick --ops
1000`).

The registry imports no suite module: flags are declared here, and a suite
module (with its torch, zmq, ...) is imported only when it runs, so `kvd
--help` stays fast. A suite that cannot run as asked raises `SuiteError`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvd_tools.bench.soak import add_arguments as _soak_arguments  # imports argparse only


class SuiteError(Exception):
    """A suite cannot run as asked (missing input, bad data); the CLI prints it, exit 2."""


@dataclass(frozen=True, slots=True)
class Suite:
    module: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    # Argument name -> its value under --quick; every suite of SUITES has some.
    quick: Mapping[str, Any] = field(default_factory=dict)


class _NotGiven:
    """The default of a flag that `--quick` sets, until `resolve_args` picks
    the default or the quick value: a flag given on the command line wins."""

    __slots__ = ("default",)

    def __init__(self, default: Any) -> None:
        self.default = default

    def __repr__(self) -> str:
        return repr(self.default)


def add_suite_arguments(p: argparse.ArgumentParser, suite: Suite) -> None:
    """The suite's flags and `--quick`, on `p`; call `resolve_args` after parsing."""
    suite.add_arguments(p)
    unknown = sorted(set(suite.quick) - set(vars(p.parse_args([]))))
    if unknown:
        raise ValueError(f"{suite.module}: --quick sets no such argument {unknown}")
    p.set_defaults(**{dest: _NotGiven(p.get_default(dest)) for dest in suite.quick})
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, a few seconds: the form `make test` runs ("
        + ", ".join(f"{dest.replace('_', '-')} {_show(v)}" for dest, v in suite.quick.items())
        + ")",
    )


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def resolve_args(suite: Suite, args: argparse.Namespace) -> argparse.Namespace:
    """`args` with each flag not given set to its `--quick` value, or its default."""
    quick = suite.quick if getattr(args, "quick", False) else {}
    for dest, value in vars(args).items():
        if isinstance(value, _NotGiven):
            setattr(args, dest, quick.get(dest, value.default))
    return args


def suite_args(name: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments suite `name` of `SUITES` runs with given `argv` (none: its defaults)."""
    p = argparse.ArgumentParser(prog=f"kvd bench {name}")
    add_suite_arguments(p, SUITES[name])
    return resolve_args(SUITES[name], p.parse_args(argv or []))


def positive_ints(text: str) -> list[int]:
    """An argparse type: `10000,100000` -> [10000, 100000]; each must be >= 1."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """An argparse type: one integer >= 1."""
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer, got {text!r}")
    return values[0]


def non_negative_int(text: str) -> int:
    """An argparse type: one integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _index_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        type=positive_ints,
        default=[10_000, 100_000, 1_000_000],
        metavar="N,...",
        help="index sizes in blocks (default: 10000,100000,1000000)",
    )
    p.add_argument(
        "--key-bytes",
        type=positive_int,
        default=36,
        metavar="N",
        help="bytes a key (default: 36, vLLM's offload keys: a 32-byte hash and 4 of group)",
    )
    p.add_argument(
        "--min-batches",
        type=positive_int,
        default=2000,
        metavar="N",
        help="steady-state batches of 64 keys to time, at least (default: 2000)",
    )
    p.add_argument(
        "--min-seconds",
        type=_non_negative_float,
        default=0.5,
        metavar="S",
        help="time each steady-state measurement for at least S seconds (default: 0.5)",
    )


def _trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        type=str,
        action="append",
        default=None,
        metavar="PATH",
        help="Mooncake-format JSONL trace; repeat for several "
        "(default: ../shared/traces/synthetic_trace.jsonl)",
    )
    p.add_argument(
        "--capacity",
        type=positive_ints,
        default=[2000, 6000, 29000],
        metavar="N,...",
        help="cache capacities in blocks (default: 2000,6000,29000)",
    )
    p.add_argument(
        "--png", type=Path, default=None, metavar="PATH", help="also plot hit rate vs capacity"
    )


def _rpc_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--clients",
        type=positive_ints,
        default=[1, 4, 8],
        metavar="N,...",
        help="client process counts (default: 1,4,8)",
    )
    p.add_argument(
        "--ops",
        type=positive_int,
        default=5000,
        metavar="N",
        help="lookups per client and per server (default: 5000)",
    )
    p.add_argument(
        "--policy",
        choices=["lru", "arc", "adaptive"],
        help="the pool's eviction policy (default: the daemon's default)",
    )
    p.add_argument(
        "--distinct",
        action="store_true",
        help="cycle through 32 different lookups instead of repeating one",
    )


def _mla_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--world-sizes",
        type=positive_ints,
        default=[2, 4],
        metavar="N,...",
        help="TP sizes (default: 2,4)",
    )


def _e2e_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt-tokens",
        type=positive_ints,
        default=[1024, 2048, 4096, 8192],
        metavar="N,...",
        help="prompt lengths in tokens (default: 1024,2048,4096,8192)",
    )
    p.add_argument(
        "--variant", choices=("mha", "mla", "both"), default="both", help="(default: both)"
    )
    p.add_argument(
        "--png", type=Path, default=None, metavar="PATH", help="also plot TTFT vs prompt length"
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=2,
        metavar="N",
        help="time each TTFT at least N times, shorter prompts more often, and keep the "
        "fastest (default: 2)",
    )


def _rates(text: str) -> list[float]:
    """An argparse type: `0,0.5,1` -> [0.0, 0.5, 1.0], each in [0, 1]."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or any(not 0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers in [0, 1], got {text!r}")
    return values


def _throughput_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hit-rates",
        type=_rates,
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        metavar="H,...",
        help="shares of prompt blocks served from kvd (default: 0,0.25,0.5,0.75,1)",
    )
    p.add_argument(
        "--variant", choices=("mha", "mla", "both"), default="both", help="(default: both)"
    )
    p.add_argument(
        "--prompts", type=positive_int, default=8, metavar="N", help="batch size (default: 8)"
    )
    p.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=2048,
        metavar="N",
        help="tokens per prompt (default: 2048)",
    )
    p.add_argument(
        "--png", type=Path, default=None, metavar="PATH", help="also plot requests/s vs hit rate"
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=2,
        metavar="N",
        help="serve the batch N times per hit rate, keep the fastest (default: 2)",
    )
    p.add_argument(
        "--gen-tokens",
        type=positive_int,
        default=1,
        metavar="N",
        help="tokens generated per request (default: 1, prefill-bound requests)",
    )


def _transfer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    p.add_argument(
        "--copier",
        choices=("auto", "native", "torch"),
        default="auto",
        help="CPU only: the native block copier, torch indexing alone, or auto "
        "(native where it was built; default)",
    )
    p.add_argument(
        "--total-mb",
        type=positive_int,
        default=256,
        metavar="MB",
        help="bytes moved per measurement, in MiB (default: 256)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        metavar="N",
        help="keep the best of N interleaved measurements (default: 5)",
    )


def _vllm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt-tokens",
        type=positive_ints,
        default=[1024, 2048, 4096, 8192],
        metavar="N,...",
        help="TTFT prompt lengths (default: 1024,2048,4096,8192)",
    )
    parser.add_argument(
        "--waiting",
        type=positive_ints,
        default=[1, 16, 64],
        metavar="N,...",
        help="waiting requests per scheduler step (default: 1,16,64)",
    )
    parser.add_argument(
        "--keys-per-request",
        type=positive_int,
        default=64,
        metavar="N",
        help="offload keys per waiting request (default: 64)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=50,
        metavar="N",
        help="scheduler steps timed per row (default: 50)",
    )
    parser.add_argument(
        "--decode-batch",
        type=positive_int,
        default=8,
        metavar="N",
        help="tokens in the decode step of the copies part (default: 8)",
    )
    parser.add_argument(
        "--store-blocks",
        type=positive_int,
        default=256,
        metavar="N",
        help="blocks stored each step in the copies part (default: 256)",
    )
    parser.add_argument(
        "--copy-steps",
        type=positive_int,
        default=30,
        metavar="N",
        help="steps of each mode timed in the copies part (default: 30)",
    )
    parser.add_argument(
        "--turns",
        type=positive_int,
        default=3,
        metavar="N",
        help="turns per conversation in the multi-turn part (default: 3)",
    )
    parser.add_argument(
        "--gpu-blocks",
        type=positive_int,
        default=128,
        metavar="N",
        help="vLLM's own KV cache in 32-token blocks, multi-turn (default: 128)",
    )
    parser.add_argument(
        "--hybrid-tokens",
        type=positive_ints,
        default=[8192],
        metavar="N,...",
        help="hybrid TTFT prompt lengths, Gemma 3 style model (default: 8192)",
    )
    parser.add_argument(
        "--parts",
        default="ttft,scheduler,multiturn,hybrid,copies",
        metavar="P,...",
        help="which parts to run (default: ttft,scheduler,multiturn,hybrid,copies)",
    )


def _sglang_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=positive_int, default=64, help="pages moved per round")
    p.add_argument("--page-tokens", type=positive_int, default=64, help="tokens per page")
    p.add_argument("--layers", type=positive_int, default=16)
    p.add_argument("--heads", type=positive_int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--rounds", type=positive_int, default=7, help="interleaved rounds (median)")
    p.add_argument("--exists-keys", type=positive_int, default=128, help="keys per batch_exists")
    p.add_argument("--exists-repeats", type=positive_int, default=50)


def _restart_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        type=positive_ints,
        default=[100_000, 1_000_000],
        metavar="N,...",
        help="pool sizes in blocks of 256 bytes (default: 100000,1000000)",
    )
    p.add_argument(
        "--tiers",
        type=_tiers,
        default=["ram", "disk"],
        metavar="T,...",
        help="ram (a pool's segment), disk (the disk tier) (default: ram,disk)",
    )
    p.add_argument(
        "--disk-sizes",
        type=positive_ints,
        default=[1_000_000],
        metavar="N,...",
        help="blocks on disk for the disk rows (default: 1000000)",
    )
    p.add_argument(
        "--disk-row-bytes",
        type=positive_int,
        default=4096,
        metavar="N",
        help="the disk rows' block size (default: 4096: 4 GiB at 1M blocks)",
    )
    p.add_argument(
        "--dir",
        default="/tmp",
        metavar="DIR",
        help="where the disk rows' disk dir goes (default: /tmp)",
    )


def _tiers(text: str) -> list[str]:
    tiers = [t.strip() for t in text.split(",") if t.strip()]
    if not tiers or set(tiers) - {"ram", "disk"}:
        raise argparse.ArgumentTypeError(f"expected ram and/or disk, got {text!r}")
    return tiers


def _lookup_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keys",
        type=positive_ints,
        default=[1, 16, 64, 256],
        metavar="N,...",
        help="keys per lookup (default: 1,16,64,256)",
    )
    p.add_argument(
        "--blocks",
        type=positive_int,
        default=100_000,
        metavar="N",
        help="blocks stored in the pool (default: 100000)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=2000,
        metavar="N",
        help="lookups timed per round and path (default: 2000)",
    )
    p.add_argument("--rounds", type=positive_int, default=3, metavar="N",
                   help="interleaved rounds (default: 3)")  # fmt: skip


def _remote_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--remote-url",
        default="",
        metavar="URL",
        help="an existing redis://host:port to use (default: a private redis-server)",
    )
    p.add_argument(
        "--value-bytes",
        type=positive_ints,
        default=[256 << 10, 2 << 20],
        metavar="N,...",
        help="block sizes fetched (default: 262144,2097152)",
    )
    p.add_argument(
        "--fetch-mib",
        type=positive_int,
        default=256,
        metavar="N",
        help="MiB of blocks fetched per size and round (default: 256)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        metavar="N",
        help="interleaved bare-GET and kvd rounds (default: 3)",
    )
    p.add_argument(
        "--lookup-keys",
        type=positive_ints,
        default=[1, 16],
        metavar="N,...",
        help="keys per lookup for the latency rows (default: 1,16)",
    )
    p.add_argument(
        "--trials",
        type=positive_int,
        default=20,
        metavar="N",
        help="lookups timed per latency row (default: 20)",
    )
    p.add_argument(
        "--trace",
        default="",
        metavar="PATH",
        help="a Mooncake-format trace (default: the conversation trace)",
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=3000,
        metavar="N",
        help="requests replayed on the two hosts (default: 3000)",
    )
    p.add_argument("--capacity", type=positive_int, default=2000, metavar="N",
                   help="blocks each host's pool holds in the replay (default: 2000)")  # fmt: skip


def _disk_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--row-bytes",
        type=positive_ints,
        default=[256 << 10, 2 << 20],
        metavar="N,...",
        help="block row sizes (default: 262144,2097152)",
    )
    p.add_argument(
        "--mib",
        type=positive_int,
        default=512,
        metavar="N",
        help="MiB of blocks stored and read back per size and round (default: 512)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        metavar="N",
        help="interleaved rounds of kvd, bare and file-per-block (default: 3)",
    )
    p.add_argument(
        "--queue-depth",
        type=positive_int,
        default=16,
        metavar="N",
        help="the daemon's disk_queue_depth and the baselines' threads (default: 16)",
    )
    p.add_argument(
        "--dir",
        default="/tmp",
        metavar="DIR",
        help="where the disk dir and the baselines' files go (default: /tmp)",
    )


def _peers_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        metavar="N",
        help="rounds of kvd, LMCache, no connector, each on fresh prompts (default: 3)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=positive_ints,
        default=[1024, 2048, 4096, 8192],
        metavar="N,...",
        help="TTFT from the cache at these prompt lengths; the "
        "longest is also the new engine's (default: 1024,2048,4096,8192)",
    )
    p.add_argument(
        "--samples",
        type=positive_int,
        default=3,
        metavar="N",
        help="samples a prompt length a round: TTFTs from the cache, and storing "
        "prefills of prompts no system has seen (default: 3)",
    )
    p.add_argument(
        "--decode-samples",
        type=positive_int,
        default=8,
        metavar="N",
        help="128-token prompts timed for the decode step a round (default: 8)",
    )
    p.add_argument(
        "--decode-tokens",
        type=positive_int,
        default=128,
        metavar="N",
        help="tokens generated for each decode sample (default: 128)",
    )
    p.add_argument(
        "--decode-engines",
        type=positive_int,
        default=3,
        metavar="N",
        help="engines a system for the decode step, all running at once, asked in "
        "turn (default: 3)",
    )
    p.add_argument(
        "--conversations",
        type=positive_int,
        default=8,
        metavar="N",
        help="multi-turn: conversations sharing one system prompt (default: 8)",
    )
    p.add_argument(
        "--turns",
        type=positive_int,
        default=6,
        metavar="N",
        help="multi-turn: turns a conversation, round robin (default: 6)",
    )
    p.add_argument(
        "--system-tokens",
        type=positive_int,
        default=1024,
        metavar="N",
        help="multi-turn: the shared system prompt (default: 1024)",
    )
    p.add_argument(
        "--user-tokens",
        type=positive_int,
        default=256,
        metavar="N",
        help="multi-turn: tokens a user turn adds (default: 256)",
    )
    p.add_argument(
        "--reply-tokens",
        type=positive_int,
        default=128,
        metavar="N",
        help="multi-turn: the scripted reply each turn adds (default: 128)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=16,
        metavar="N",
        help="multi-turn: tokens generated a request (default: 16)",
    )
    p.add_argument(
        "--hook-times",
        type=Path,
        default=None,
        metavar="DIR",
        help="time kvd's connector hooks in every kvd engine process, one JSON file "
        "a process in DIR, summed up under the table (where a step's time goes)",
    )
    p.add_argument(
        "--step-times",
        type=Path,
        default=None,
        metavar="DIR",
        help="time the parts of a step (scheduler, forward pass, sampling, each "
        "connector's hooks) in every system's decode engines, one JSON file a process "
        "in DIR, each part's median call by system under the table",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="PATH",
        help="trace_replay: a JSONL trace of hash_ids (default: the shared Mooncake trace)",
    )
    p.add_argument(
        "--trace-requests",
        type=non_negative_int,
        default=200,
        metavar="N",
        help="trace_replay: requests replayed, 0 for none (default: 200)",
    )
    p.add_argument(
        "--trace-every",
        type=positive_int,
        default=20,
        metavar="K",
        help="trace_replay: every Kth request of the trace, so that the replayed "
        "ones span it and its prefixes recur (default: 20)",
    )
    p.add_argument(
        "--trace-max-tokens",
        type=positive_int,
        default=4,
        metavar="N",
        help="trace_replay: tokens generated a request (default: 4)",
    )
    p.add_argument(
        "--trace-block-tokens",
        type=positive_int,
        default=16,
        metavar="N",
        help="trace_replay: tokens a trace block stands for (the trace's are 512; "
        "default: 16, so a request is hundreds of tokens on this CPU)",
    )
    p.add_argument(
        "--gpu-blocks",
        type=positive_int,
        default=None,
        metavar="N",
        help="the new engine's own KV cache in 32-token blocks of a prompt (gemma3: "
        "and its sliding windows'): the longest prompt fits, the conversations do "
        "not (default: 272, gemma3 1100)",
    )
    p.add_argument(
        "--model",
        choices=["llama", "gemma3"],
        default="llama",
        help="kvd bench vllm's Llama (one KV cache group), or its Gemma 3 (five "
        "sliding-window layers to one full: six groups) (default: llama)",
    )
    p.add_argument(
        "--l1-gb",
        type=float,
        default=2.0,
        metavar="GB",
        help="LMCache's --l1-size-gb and kvd's pool (default: 2)",
    )
    p.add_argument(
        "--lmcache-venv",
        type=Path,
        default=None,
        metavar="DIR",
        help="LMCache's venv (default: $KVD_LMCACHE_VENV, else .venv-lmcache)",
    )
    p.add_argument(
        "--lmcache-args",
        default="",
        metavar="ARGS",
        help="more flags for `lmcache server` (e.g. '--chunk-size 32')",
    )
    p.add_argument(
        "--lmcache-transport",
        choices=["shm", "pickle"],
        default="shm",
        help="how LMCache's CPU path moves pages: its L1 in shared memory (--shm-name, "
        "the default here) or pickled over ZMQ (LMCache's own default)",
    )
    p.add_argument(
        "--dump",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write every round's samples, generated tokens included, as JSON",
    )
    p.add_argument(
        "--systems",
        default="kvd,lmcache,none",
        metavar="S,...",
        help="which systems run, in this order each round (default: kvd,lmcache,none); "
        "kvd-off: kvd's connector with no daemon (vLLM's offloading KV layout and kvd's "
        "hooks, nothing cached), the baseline for what kvd's own work costs",
    )
    p.add_argument(
        "--if-no-lmcache",
        choices=["error", "skip"],
        default="error",
        help="without LMCache's venv: fail (default), or skip with a message",
    )


SUITES: dict[str, Suite] = {
    "index": Suite(
        "kvd_tools.bench.index",
        "block index: us per key and bytes per block, by size and policy",
        _index_arguments,
        {"sizes": [1000, 4000], "min_batches": 20, "min_seconds": 0.0},
    ),
    "trace": Suite(
        "kvd_tools.bench.trace",
        "hit rate of each policy and of Belady's optimum replaying a request trace",
        _trace_arguments,
        {"capacity": [2000]},
    ),
    "rpc": Suite(
        "kvd_tools.bench.rpc",
        "lookup of 64 keys: p50/p99 and ops/s at 1, 4, 8 clients, against a bare pyzmq echo",
        _rpc_arguments,
        {"clients": [1, 2], "ops": 300},
    ),
    "mla": Suite(
        "kvd_tools.bench.mla",
        "host and device-to-host bytes per block, replicated vs sharded, at TP=N",
        _mla_arguments,
        {"world_sizes": [2]},
    ),
    "e2e": Suite(
        "kvd_tools.bench.e2e",
        "demo engine time to first token: cached prefix vs recompute, by prompt length",
        _e2e_arguments,
        {"prompt_tokens": [64, 256], "repeats": 1, "variant": "mha"},  # throughput: mla
    ),
    "throughput": Suite(
        "kvd_tools.bench.throughput",
        "demo engine requests/s at kvd hit rates from 0 to 1",
        _throughput_arguments,
        {
            "hit_rates": [0.0, 1.0],
            "prompts": 2,
            "prompt_tokens": 256,
            "repeats": 1,
            "variant": "mla",
        },
    ),
    "soak": Suite(
        "kvd_tools.bench.soak",
        "the daemon under faults: ops, faults, violations (must be 0), RSS after warm-up",
        _soak_arguments,
        {"seconds": 10.0},
    ),
    "transfer": Suite(
        "kvd_tools.bench.transfer",
        "scattered store/load GB/s through the copy backend vs one contiguous torch copy",
        _transfer_arguments,
        {"total_mb": 8, "repeats": 1},
    ),
    "lookup": Suite(
        "kvd_tools.bench.lookup",
        "Scheduler.lookup from the ready table vs the round trip vs BlockIndex in process",
        _lookup_arguments,
        {"keys": [1, 64], "blocks": 2000, "repeats": 200, "rounds": 1},
    ),
    "sglang": Suite(
        "kvd_tools.bench.sglang_bench",
        "SGLang HiCache pages set/get GB/s on kvd vs its HiCacheFile vs memcpy; batch_exists",
        _sglang_arguments,
        {"pages": 8, "page_tokens": 16, "layers": 4, "rounds": 2, "exists_repeats": 5},
    ),
    "restart": Suite(
        "kvd_tools.bench.restart",
        "the cache across a daemon SIGKILL: blocks back and verified, seconds to the first hit",
        _restart_arguments,
        {"sizes": [2000], "disk_sizes": [10_000]},
    ),
    "remote": Suite(
        "kvd_tools.bench.remote",
        "the remote tier on Redis: fetch GB/s vs a bare GET, remote lookup latency, 2-host trace",
        _remote_arguments,
        {
            "value_bytes": [64 << 10],
            "fetch_mib": 8,
            "rounds": 1,
            "lookup_keys": [1],
            "trials": 3,
            "requests": 200,
            "capacity": 200,
        },
    ),
    "disk": Suite(
        "kvd_tools.bench.disk",
        "the disk tier: fetch and store GB/s vs bare O_DIRECT and vs a file per block",
        _disk_arguments,
        {"row_bytes": [256 << 10, 2 << 20], "mib": 8, "rounds": 1},
    ),
    "vllm": Suite(
        "kvd_tools.bench.vllm_bench",
        "real vLLM with kvd: TTFT vs recompute, scheduler cost vs vLLM's own manager, chat",
        _vllm_arguments,
        {
            "prompt_tokens": [256],
            "waiting": [1, 4],
            "keys_per_request": 16,
            "steps": 5,
            "hybrid_tokens": [1024],
            "parts": "ttft,scheduler,hybrid,copies",
            "store_blocks": 16,
            "copy_steps": 3,
        },
    ),
    "peers": Suite(
        "kvd_tools.bench.peers",
        "the same vLLM workload with kvd, LMCache's MP server and no connector, alternated",
        _peers_arguments,
        {
            "rounds": 1,
            "prompt_tokens": [512],
            "samples": 1,
            "decode_samples": 1,
            "decode_tokens": 16,
            "decode_engines": 1,
            "trace_requests": 8,
            "trace_block_tokens": 4,
            "conversations": 2,
            "turns": 2,
            "system_tokens": 256,
            "user_tokens": 64,
            "reply_tokens": 32,
            "max_tokens": 4,
            "gpu_blocks": 24,
            "if_no_lmcache": "skip",
        },
    ),
}
