"""Runs in every kvd process: the wire protocol, defined once for both sides (SPEC section 6).

ZeroMQ DEALER (client) to ROUTER (daemon). Every frame is one msgpack message
of a tagged, frozen msgspec Struct; `Request` and `Reply` are the two unions
of the control channel. All messages are `array_like` (no field names on
the wire; msgspec cannot mix encodings in one union). Each request carries
a client-chosen `req_id` that its reply echoes, so a client may pipeline.
Fields are only ever appended, with defaults. `TransferJob` is pushed by
the daemon to workers with `req_id = 0`.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from kvd_client.types import JobKind

# 2: the rows start at `Attached.data_offset` (SPEC 13); a version-1 client,
# which maps them from offset 0, would write over the segment's slot table.
PROTOCOL_VERSION = 2
MAX_FRAME_BYTES = 8 << 20
MAX_KEYS_PER_REQUEST = 65_536
MAX_KEY_BYTES = 64
MAX_OBSERVED_LOOKUPS = 1024  # lookups one `Observe` may report
MAX_NAME_CHARS = 128
MAX_LAYOUT_CHARS = 1024  # model identity and engine fingerprint

# Bounds are part of the schema, so msgspec checks them while decoding (in C)
# and a violation becomes a BAD_REQUEST naming the field.
Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
DeviceBlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
DeviceBlockIds = Annotated[list[DeviceBlockId], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
# Every number and string a client sends is bounded here, so no sum of them
# the daemon keeps (counters, a job's bytes) can outgrow what msgpack encodes.
ReqId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
JobId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]  # one rank's share of one job
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e6)]
Detail = Annotated[str, msgspec.Meta(max_length=1000)]
Token = Annotated[str, msgspec.Meta(max_length=256)]
PoolName = Annotated[str, msgspec.Meta(max_length=MAX_LAYOUT_CHARS)]  # the rule: valid_pool_name
Role = Literal["scheduler", "worker", "admin"]
# A pool name names a segment (/kvd.<pool>.<generation>) and a metrics label.
POOL_NAME_PATTERN = r"^[A-Za-z0-9_-]+$"
_POOL_NAME = re.compile(POOL_NAME_PATTERN)


def valid_pool_name(name: str) -> bool:
    """The pool-name rule, for the config, `Attach` and tools: 1 to `MAX_NAME_CHARS`
    ASCII letters, digits, `-` and `_`."""
    return len(name) <= MAX_NAME_CHARS and _POOL_NAME.fullmatch(name) is not None


Name = Annotated[str, msgspec.Meta(max_length=MAX_LAYOUT_CHARS)]


MAX_GROUPS = 64  # KV cache groups a layout may name


class Group(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV cache group of an engine, as vLLM names it (SPEC sections 8 and 12).

    `kind` is vLLM's `KVCacheSpecKind` value ("full_attention",
    "sliding_window", "mamba", ...), `block_tokens` the group's tokens per
    block, `sliding_window` the window of a sliding-window group."""

    kind: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    block_tokens: Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
    sliding_window: Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)] | None = None


class Layout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The geometry and identity an engine attaches to a pool with (SPEC section 3).

    `groups` names the engine's KV cache groups in vLLM's order (a group's
    index is its `group_idx`); empty for an engine that names none (a
    one-group engine of an older client, the tools), whose events carry no
    kind."""

    model: Name
    dtype: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
    block_tokens: Annotated[int, msgspec.Meta(lt=1 << 31)]
    world_size: Annotated[int, msgspec.Meta(lt=1 << 31)]
    replicated: bool
    slot_bytes: Annotated[int, msgspec.Meta(le=1 << 40)]
    extra: Name = ""
    groups: Annotated[tuple[Group, ...], msgspec.Meta(max_length=MAX_GROUPS)] = ()


class _Msg(msgspec.Struct, frozen=True, tag=True, array_like=True):
    # Every message is array-like: msgspec cannot mix the two encodings in one
    # union, and the hot ones must be. Tags are the class names.
    req_id: ReqId


# -- requests ----------------------------------------------------------------


class Hello(_Msg, frozen=True):
    protocol_version: Count
    role: Role
    engine_id: Name = ""
    rank: Rank = 0
    world_size: Count = 1
    pid: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)] = 0
    # Chosen once per client process (per `Connection`): a reconnect of the same
    # worker process presents it again and inherits its jobs.
    instance: Annotated[str, msgspec.Meta(max_length=64)] = ""


class Attach(_Msg, frozen=True):
    pool: PoolName
    layout: Layout
    capacity_bytes: Annotated[int, msgspec.Meta(le=1 << 50)] | None = None


class Lookup(_Msg, frozen=True):
    """Leading ready keys; with `pin`, those keys are also pinned for a load, as
    `PrepareLoad` of them would, in the same step (one round trip, no race)."""

    keys: Keys
    pin: bool = False


class Observe(_Msg, frozen=True):
    """Lookups a scheduler answered from the pool's ready table (SPEC section 15),
    reported in a batch so that the admission policy learns from them."""

    lookups: Annotated[list[Keys], msgspec.Meta(max_length=MAX_OBSERVED_LOOKUPS)]
    hits: Annotated[list[Count], msgspec.Meta(max_length=MAX_OBSERVED_LOOKUPS)] = []


class PrepareLoad(_Msg, frozen=True):
    keys: Keys


class Touch(_Msg, frozen=True):
    keys: Keys


class CompleteLoad(_Msg, frozen=True):
    keys: Keys


class PrepareStore(_Msg, frozen=True):
    keys: Keys


class CompleteStore(_Msg, frozen=True):
    keys: Keys
    success: bool = True


class Store(_Msg, frozen=True):
    keys: Keys
    device_block_ids: DeviceBlockIds


class Load(_Msg, frozen=True):
    keys: Keys
    device_block_ids: DeviceBlockIds


class Finished(_Msg, frozen=True):
    """Jobs finished since the last call (`FinishedResult`)."""


class JobDone(_Msg, frozen=True):
    job_id: JobId
    rank: Rank
    ok: bool
    nbytes: Bytes = 0
    seconds: Seconds = 0.0
    detail: Detail = ""


class Heartbeat(_Msg, frozen=True):
    """Renews the lease; any message does, this one carries nothing else."""


class Stats(_Msg, frozen=True):
    """Counters and pools (`StatsResult`)."""


class Pools(_Msg, frozen=True):
    """The pools (`PoolsResult`)."""


class DropPool(_Msg, frozen=True):
    """Frees a pool. Only for the daemon's operators: `token` must be the one in
    `<runtime_dir>/admin.token`, which only the service user and root can read."""

    pool: PoolName
    token: Token = ""


class Reset(_Msg, frozen=True):
    """Empties a pool. Needs the operator token, or a session attached to the pool."""

    pool: PoolName
    token: Token = ""


class CheckInvariants(_Msg, frozen=True):
    """Debug: runs the SPEC section 4 invariant check on every pool (operator token)."""

    token: Token = ""


class Goodbye(_Msg, frozen=True):
    """Ends the session now instead of at lease expiry (same rollback)."""


Request = (
    Hello
    | Attach
    | Lookup
    | Observe
    | PrepareLoad
    | Touch
    | CompleteLoad
    | PrepareStore
    | CompleteStore
    | Store
    | Load
    | Finished
    | JobDone
    | Heartbeat
    | Stats
    | Pools
    | DropPool
    | Reset
    | CheckInvariants
    | Goodbye
)

# -- replies -----------------------------------------------------------------


class Welcome(_Msg, frozen=True):
    session_id: int
    lease_ms: int
    daemon_version: str


class Attached(_Msg, frozen=True):
    shm_name: str
    generation: int
    num_blocks: int
    row_bytes: int
    slot_bytes: int
    num_slots: int
    slot_stride: int
    ready_table: str = ""  # the pool's ready table (SPEC section 15); "" when none
    data_offset: int = 0  # where the rows start in the segment (SPEC section 13)
    # The pool has a tier below RAM, disk or remote (SPEC 14, 16): a lookup the
    # ready table answers short of all its keys asks the daemon, which may read
    # the rest.
    remote: bool = False


class Ok(_Msg, frozen=True):
    """The request was done; nothing to return."""


class LookupResult(_Msg, frozen=True):
    hits: int | None
    slots: list[int] = []  # with `Lookup.pin`: the pinned slots of the leading hits


class SlotsResult(_Msg, frozen=True):
    """`prepare_load`: slot ids in the order of the keys."""

    slots: list[int]


class PrepareStoreResult(_Msg, frozen=True):
    """`prepare_store`; `fits = False` is the index's `None`."""

    fits: bool
    keys_to_store: list[bytes] = []
    slots: list[int] = []
    evicted_keys: list[bytes] = []


class StoreTicket(_Msg, frozen=True):
    """`store`: `fits = False` is "nothing fits"; `job_id` None when all was stored."""

    fits: bool
    job_id: int | None = None
    keys_to_store: list[bytes] = []
    evicted_keys: list[bytes] = []


class LoadTicket(_Msg, frozen=True):
    job_id: int


class JobResult(msgspec.Struct, frozen=True, array_like=True):
    job_id: int
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    detail: str = ""


class FinishedResult(_Msg, frozen=True):
    results: list[JobResult]


class PoolInfo(msgspec.Struct, frozen=True):
    name: str
    shm_name: str
    generation: int
    layout: Layout
    policy: str
    num_blocks: int
    row_bytes: int
    capacity_bytes: int
    blocks_ready: int
    blocks_in_flight: int
    blocks_pinned: int
    blocks_free: int
    sessions: int
    # Slots a warm start holds back while a job of the dead daemon may still
    # write them (SPEC 13): neither free nor holding a block.
    blocks_held: int = 0
    # The pool's slab (SPEC 16): blocks it holds, and rows it has; 0 without one.
    disk_blocks: int = 0
    disk_capacity_blocks: int = 0


class PoolsResult(_Msg, frozen=True):
    pools: list[PoolInfo]


class StatsResult(_Msg, frozen=True):
    daemon_version: str
    uptime_s: float
    sessions: int
    jobs_in_flight: int
    lease_expirations: int
    max_total_bytes: int
    used_bytes: int
    pools: list[PoolInfo]
    counters: dict[str, int]


class InvariantsResult(_Msg, frozen=True):
    problems: list[str]


class Error(_Msg, frozen=True):
    code: str
    detail: str


class TransferJob(_Msg, frozen=True):
    """Pushed to each registered rank of an engine: copy between device blocks and pool rows."""

    job_id: int
    kind: JobKind
    pool: str
    generation: int
    device_block_ids: list[int]
    pool_block_ids: list[int]
    writer: bool = True
    # The daemon's `time.monotonic()` past which the job has failed: CLOCK_MONOTONIC,
    # one clock for every process on a host. A worker never starts it later. 0 = none.
    deadline: float = 0.0


Reply = (
    Welcome
    | Attached
    | Ok
    | LookupResult
    | SlotsResult
    | PrepareStoreResult
    | StoreTicket
    | LoadTicket
    | FinishedResult
    | PoolsResult
    | StatsResult
    | InvariantsResult
    | Error
    | TransferJob
)

# Built once: decoders and encoders are reused for every frame.
request_decoder: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(Request)
reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()
