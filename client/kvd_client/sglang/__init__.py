"""Runs in SGLang's scheduler processes (one per TP rank): kvd as a HiCache storage backend.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvd",
      "module_path": "kvd_client.sglang", "class_name": "KvdHiCacheStorage",
      "interface_v1": 1}'

SGLang's cache controller calls the backend from its prefetch and backup
threads; `KvdHiCacheStorage` (`storage`) stores SGLang's host pool pages as
kvd blocks (`pages`: which pool, and the pages as views), keyed by SGLang's
page hashes (`keys`). `import kvd_client` never imports this package, nor
SGLang.
"""

from kvd_client.sglang.storage import KvdHiCacheStorage

__all__ = ["KvdHiCacheStorage"]
