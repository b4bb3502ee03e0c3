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
# Inside those 360 s: the tests get 180 s, the bench 120 s (128 MiB a row, 3
# repeats), the rest (installing the wheels, torch's start) about 60 s; each
# step is cut by `timeout`, so a hung one still leaves its output under $OUT.
#
# kvd, kvd_client and kvd_tools (`kvd bench`) run from the tree (PYTHONPATH);
# the CUDA backend needs no compiled part of kvd_client. Exit status: non-zero
# if either step failed.
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
OUT="$out" timeout 180 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$out/tests.txt"
tests=${PIPESTATUS[0]}
timeout 120 python3 -m kvd bench transfer --device cuda --total-mb 128 --repeats 3 \
    --json "$out/transfer_cuda.json" 2>&1 | tee "$out/bench.txt"
bench=${PIPESTATUS[0]}
echo "on_device: tests rc=$tests, bench rc=$bench" | tee -a "$out/device.txt"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
