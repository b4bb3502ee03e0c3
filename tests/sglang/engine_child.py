"""Runs as an "SGLang engine" process of the tests: SGLang's host pool and kvd's backend.

    python -m tests.sglang.engine_child ENDPOINT POOL store|load SEED[,SEED...]

Each seed is a prompt of `NUM_PAGES` pages whose pages hold bytes drawn from
the seed (the same in every process). "store" fills host pool pages with
them and stores them under the prompt's page hashes (`batch_set_v1`);
"load" asks `batch_exists` and loads them with `batch_get_v1` into fresh
host pages, and compares. Prints one JSON line: per seed, the results.
"""

from __future__ import annotations

import json
import sys

import torch

from kvd_tools import sglang_harness as h

PAGE = 16
NUM_PAGES = 8


def pages_of(seed: int, num_pages: int, page_bytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8, generator=g)


def main() -> None:
    endpoint, pool, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    seeds = [int(s) for s in sys.argv[4].split(",")]
    h.import_sglang()
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    host = h.host_pool(h.device_pool(tokens=256, page_size=PAGE), layout="page_first")
    backend = StorageBackendFactory.create_backend(
        "dynamic", h.storage_config(h.kvd_extra(endpoint, pool)), host
    )
    backend.register_mem_pool_host(host)
    out: dict[int, dict[str, object]] = {}
    for seed in seeds:
        tokens = [seed * 100_000 + i for i in range(NUM_PAGES * PAGE)]
        keys = h.page_hashes(tokens, PAGE)
        want = pages_of(seed, NUM_PAGES, host.size_per_token * PAGE)
        idx = host.alloc(NUM_PAGES * PAGE)
        if mode == "store":
            for i in range(NUM_PAGES):
                host.set_from_flat_data_page(int(idx[i * PAGE]), want[i].view(host.dtype))
            out[seed] = {"stored": backend.batch_set_v1(keys, idx)}
        else:
            out[seed] = {
                "exists": backend.batch_exists(keys),
                "loaded": backend.batch_get_v1(keys, idx),
                "equal": [
                    bool(
                        torch.equal(
                            host.get_data_page(int(idx[i * PAGE])).view(torch.uint8), want[i]
                        )
                    )
                    for i in range(NUM_PAGES)
                ],
            }
    backend.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
