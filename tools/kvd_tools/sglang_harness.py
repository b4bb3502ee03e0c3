"""Runs in tests and `kvd bench sglang`: SGLang's host pools and cache controller on CPU.

SGLang 0.5.23's host pools import `sglang.srt.configs`, whose InternVL and
Nemotron-VL configs import torchvision at module level (for image
preprocessing: `sglang/srt/multimodal/internvl_utils.py`,
`nano_nemotron_vl.py`). No torchvision loads next to this host's CPU torch
(PyPI's 0.28 needs libtorch_cuda: "operator torchvision::nms does not
exist"), and make does not install one, since vLLM would then fail to start
on it. So `import_sglang()` gives those module-level imports an absent
torchvision: a module whose names resolve, for the definitions that use them
at import, and raise if anything calls them (no image is processed here).
transformers decides whether torchvision is there before, from the
installed distributions, so it runs without it as it does for vLLM.

`missing()` says in one line why SGLang cannot be used, for skips.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _Absent(types.ModuleType):
    """A torchvision name that resolves at import time and fails when used."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        child = _Absent(f"{self.__name__}.{name}")
        child.__path__ = []
        return child

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.__name__}: torchvision is not installed (tests/sglang)")


class _AbsentFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Absent(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the placeholder's attributes are made on first use."""


def import_sglang() -> None:
    """Imports SGLang's storage layer, host pools and cache controller; raises ImportError."""
    try:
        importlib.import_module("torchvision")
        real = True
    except ImportError:
        real = False
    except RuntimeError:  # a torchvision that does not load with this torch
        real = False
    if not real and not any(isinstance(f, _AbsentFinder) for f in sys.meta_path):
        importlib.import_module("transformers.utils.import_utils")  # decides "no torchvision"
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _AbsentFinder())
    importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
    importlib.import_module("sglang.srt.mem_cache.memory_pool_host")
    importlib.import_module("sglang.srt.managers.cache_controller")


def missing() -> str | None:
    """None when SGLang's storage layer imports; else why, in one line."""
    try:
        import_sglang()
    except Exception as exc:  # ImportError, or what a half-installed SGLang raises
        return f"sglang not importable ({type(exc).__name__}: {exc}); make venv installs it"
    return None


# -- SGLang's own objects, built as its scheduler builds them, on the CPU -------


def storage_config(extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1,
                   mla: bool = False, model: str = "tiny") -> Any:  # fmt: skip
    """SGLang's `HiCacheStorageConfig` of one rank, with `extra` as the extra config."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=False, model_name=model, extra_config=dict(extra),
    )  # fmt: skip


def device_pool(*, tokens: int, page_size: int, layers: int = 2, heads: int = 2,
                head_dim: int = 64, dtype: Any = None, mla: bool = False) -> Any:  # fmt: skip
    """SGLang's device KV pool (MHA, or MLA with a latent of `head_dim`) on the CPU."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    dtype = dtype or torch.bfloat16
    if mla:
        return MLATokenToKVPool(
            size=tokens, page_size=page_size, dtype=dtype, kv_lora_rank=head_dim,
            qk_rope_head_dim=16, layer_num=layers, device="cpu",
            enable_memory_saver=False, start_layer=0, end_layer=layers - 1,
        )  # fmt: skip
    return MHATokenToKVPool(
        size=tokens, page_size=page_size, dtype=dtype, head_num=heads, head_dim=head_dim,
        layer_num=layers, device="cpu", enable_memory_saver=False, start_layer=0,
        end_layer=layers - 1,
    )  # fmt: skip


def host_pool(device: Any, *, layout: str, ratio: float = 2.0) -> Any:
    """SGLang's host pool (`MHATokenToKVPoolHost` / `MLATokenToKVPoolHost`) of `device`."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    info = device.get_device_pool_infos()[0].buffer_info
    common = dict(
        device_capacity_tokens=device.size, start_layer=device.start_layer,
        end_layer=device.end_layer,
    )  # fmt: skip
    if isinstance(device, MLATokenToKVPool):
        return MLATokenToKVPoolHost(info, ratio, 0, device.page_size, layout, pin_memory=False,
                                    device="cpu", target_layer_num=device.layer_num,
                                    **common)  # fmt: skip
    return MHATokenToKVPoolHost(info, ratio, 0, device.page_size, layout, pin_memory=False,
                                device="cpu", **common)  # fmt: skip


def controller(device: Any, host: Any, extra: dict[str, Any], *, backend: str = "dynamic") -> Any:
    """SGLang's `HiCacheController` over `host`, with storage `backend` attached
    (its prefetch, prefetch I/O and backup threads running), TP 1."""
    import threading

    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                        attn_dcp_size=1, attn_dcp_rank=0)  # fmt: skip
    alloc = TokenToKVPoolAllocator(device.size, device.dtype, "cpu", device, need_sort=False)
    del torch
    return HiCacheController(
        alloc, host, host.page_size, tp_group=None, load_cache_event=threading.Event(),
        write_policy="write_through", io_backend="direct", storage_backend=backend,
        storage_backend_extra_config=dict(extra), model_name="tiny",
    )  # fmt: skip


def kvd_extra(endpoint: str, pool: str, **more: Any) -> dict[str, Any]:
    """The extra config that loads kvd through SGLang's `dynamic` backend."""
    return {
        "backend_name": "kvd", "module_path": "kvd_client.sglang",
        "class_name": "KvdHiCacheStorage", "interface_v1": 1,
        "kvd_endpoint": endpoint, "kvd_pool": pool, **more,
    }  # fmt: skip


def page_hashes(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's storage page hashes of `tokens` (its own `get_hash_str` chain)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    out: list[str] = []
    prior = None
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prior = get_hash_str(tokens[i : i + page_size], prior)
        out.append(prior)
    return out
