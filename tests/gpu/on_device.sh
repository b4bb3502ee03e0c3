#!/usr/bin/env bash
# Runs on a lent GPU machine (the workplace's `device` tool): the CUDA tests and
# `kvd bench transfer --device cuda`, as one script, results under $OUT.
#
# That machine has Python 3.12 with CUDA torch, uvloop and prometheus-client,
# but not pyzmq, msgspec or posix_ipc, and it cannot download. Prepare here:
#
#     make gpu-wheels                 # those three, as wheels, into .whl/
#
# then run it there (one call; the limit leaves room for a rerun):
#
#     run(command="bash tests/gpu/on_device.sh", carry=[".whl"], timeout_s=360)
#
# Inside those 360 s: a preflight (below) gets up to 30 s but takes seconds,
# the tests 180 s, the bench 120 s (128 MiB a row, 3 repeats), the rest
# (installing the wheels, torch's start) a few seconds; each step is cut by
# `timeout`, so a hung one still leaves its output under $OUT.
#
# kvd, kvd_client and kvd_tools (`kvd bench`) run from the tree (PYTHONPATH);
# the CUDA backend needs no compiled part of kvd_client. Exit status: non-zero
# if the preflight, the tests or the bench failed.
#
# tests/gpu holds the vLLM plug-in's copies too (test_vllm_copies_cuda.py:
# `kvd_client.vllm.copies`, which imports no vLLM, on tensors shaped as vLLM's
# canonical KV caches): bytes round trip, store and load GB/s against a plain
# pinned copy_ (goal >= 0.9x, figures in $OUT/vllm_copies.json), no host
# synchronization inside submit. vLLM itself is not installed there: its CUDA
# wheels (hundreds of MB, with their CUDA dependencies) exceed what a run
# carries (64 MiB), and the machine cannot download.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/kvd-gpu}
wheels=${KVD_WHEELS:-.whl}
site=${KVD_SITE:-/tmp/kvd-site}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl || { echo "on_device: could not install $wheels"; exit 2; }
export PYTHONPATH="$PWD:$PWD/client:$PWD/tools:$site" PYTHONUNBUFFERED=1
{ df -h /dev/shm 2>&1; nvidia-smi -L 2>&1; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"; } | tee "$out/device.txt"
# Skipped CUDA tests must not pass for a run: no device is a failure here.
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" \
    || { echo "on_device: torch sees no CUDA device" | tee -a "$out/device.txt"; exit 3; }
# Preflight: can kvd pin a /dev/shm mapping here (a sandbox such as gVisor may
# refuse)? 4 MiB through kvd's CUDA backend, then a kernel: a CUDA error left
# pending by a refusal would fail it. Pinned: again in 4 pieces, as a pool
# past 64 GiB is (rc 6 if that alone fails). Refused: an anonymous mapping is
# tried too; if that pins (rc 4), the tests that need no /dev/shm and the
# bench still run; if neither pins (rc 5), nothing else does. One line each
# way; any other failure of the preflight itself runs everything.
timeout 30 python3 - <<'EOF' 2>&1 | tee -a "$out/device.txt"
import mmap, os, sys
import torch
from kvd_client.backends import host_pin, make_backend
from kvd_client.geometry import Geometry

geometry = Geometry.plan(slot_bytes=256 << 10, world_size=1, replicated=False,
                         capacity_bytes=4 << 20)
kv = torch.zeros(geometry.num_blocks, 256 << 10, dtype=torch.uint8, device="cuda")

def pin(region, piece=64 << 30):
    """None if kvd's backend pinned `region` (in pieces of `piece` bytes), else why not."""
    host_pin._REFUSED.clear()
    host_pin.MAX_REGISTER_BYTES = piece
    why = None
    try:
        make_backend("cuda", kv, region, geometry, 0).close()
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError as exc:
        why = f"{why}; the next kernel failed too (a CUDA error left pending): {exc}"
    return why

path = f"/dev/shm/kvd-preflight-{os.getpid()}"
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
try:
    os.ftruncate(fd, geometry.size_bytes)
    shm = mmap.mmap(fd, geometry.size_bytes)
finally:
    os.close(fd)
    os.unlink(path)
why = pin(shm)
if why is None:
    pieces = pin(shm, 1 << 20)
    print("on_device: preflight: kvd pinned a 4 MiB /dev/shm mapping; in 4 pieces: "
          f"{'pinned' if pieces is None else pieces}")
    sys.exit(0 if pieces is None else 6)
anon = pin(mmap.mmap(-1, geometry.size_bytes))
print(f"on_device: preflight: kvd cannot pin a /dev/shm mapping here ({why}); an anonymous "
      f"mapping: {'pinned' if anon is None else anon}")
sys.exit(4 if anon is None else 5)
EOF
pre=${PIPESTATUS[0]}
tests=skipped bench=skipped
if [ "$pre" != 5 ]; then
    ignore=""  # /dev/shm refused: the plug-in's copies map their segment there
    [ "$pre" = 4 ] && ignore=--ignore=tests/gpu/test_vllm_copies_cuda.py
    OUT="$out" timeout 180 python3 -m pytest -q -p no:cacheprovider $ignore tests/gpu 2>&1 \
        | tee "$out/tests.txt"
    tests=${PIPESTATUS[0]}
    timeout 120 python3 -m kvd bench transfer --device cuda --total-mb 128 --repeats 3 \
        --json "$out/transfer_cuda.json" 2>&1 | tee "$out/bench.txt"
    bench=${PIPESTATUS[0]}
fi
echo "on_device: preflight rc=$pre, tests rc=$tests, bench rc=$bench" | tee -a "$out/device.txt"
[ "$pre" = 0 ] && [ "$tests" = 0 ] && [ "$bench" = 0 ]
