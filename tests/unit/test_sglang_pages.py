"""The SGLang backend's pool choice (`kvd_client.sglang.pages.choose_pool`), without SGLang."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvd_client.errors import BadRequest
from kvd_client.sglang.pages import choose_pool


def storage_config(**sizes: int) -> SimpleNamespace:
    base = {"tp_size": 2, "tp_rank": 0, "is_mla_model": True, "extra_config": {},
            "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1,
            "dcp_size": 1, "dp_rank": 0, "model_name": "m"}  # fmt: skip
    return SimpleNamespace(**{**base, **sizes})


@pytest.mark.parametrize("sizes", [{"dcp_size": 2}, {"attn_cp_size": 2}])
def test_mla_with_context_parallel_shards_is_refused(sizes: dict[str, int]) -> None:
    """Each DCP / attention-CP rank holds another shard of the MLA KV: one replicated
    pool would serve one shard's bytes to every rank (cold review)."""
    with pytest.raises(BadRequest, match="context parallelism"):
        choose_pool(storage_config(**sizes), SimpleNamespace())
