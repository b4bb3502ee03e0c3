"""Runs in a vLLM engine process (tests, `kvd bench vllm`): one `vllm.LLM`, driven over stdin.

`python -m kvd_tools.vllm_harness.engine CONFIG_JSON` builds `vllm.LLM` on a model
directory holding only a `config.json` (dummy weights: no hub, no
tokenizer), optionally with kvd's connector, then answers one JSON command
per stdin line, on one stdout line that starts with `{` (vLLM's own logs go to
stderr: the driver sets `VLLM_LOGGING_STREAM`):

    {"prompts": [[token ids], ...], "max_tokens": N}  -> {"tokens": [[...], ...], "seconds": s}
    {"reset_prefix_cache": true}                       -> {"ok": true}
    {"reset_prefix_cache": true, "reset_connector": true}  -> {"ok": true} (the connector's too)
    {"metrics": true}      -> {"metrics": {name: value}}, vLLM's `vllm:kv_offload*` counters

CONFIG_JSON keys: `model` (a directory), `kvd` (extra-config keys, or null for
no connector), and optional `tp`, `max_model_len`, `num_gpu_blocks`
(vLLM's `num_gpu_blocks_override`), `dtype`. vLLM spawns processes of its
own, so everything runs under `__main__`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# A tiny DeepSeek-V2: MLA attention (one latent KV shared by all heads, so
# vLLM's TP ranks hold the same KV: its replicated layout), dense MLPs only.
TINY_DEEPSEEK: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 512,  # latent 512 + rope 64: the one size vLLM's CPU MLA kernel takes
    "q_lora_rank": None,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32


def write_model(directory: Path, config: dict[str, Any] = TINY_LLAMA) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The `--kv-transfer-config` of the README, with `extra` keys added."""
    return {
        "kv_connector": "KvdOffloadingConnector",
        "kv_connector_module_path": "kvd_client.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "KvdOffloadingSpec",
            "spec_module_path": "kvd_client.vllm",
            **extra,
        },
    }


def main(config: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": config["model"],
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "gpu_memory_utilization": 0.1,
        "max_model_len": config.get("max_model_len", 4096),
        "enforce_eager": True,
        "seed": 0,
        "block_size": BLOCK_SIZE,
        "tensor_parallel_size": config.get("tp", 1),
        "disable_log_stats": False,  # the connector's figures reach vLLM's metrics
    }
    if config.get("num_gpu_blocks") is not None:
        kwargs["num_gpu_blocks_override"] = config["num_gpu_blocks"]
    if config.get("dtype") is not None:
        kwargs["dtype"] = config["dtype"]
    if config.get("kvd") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config(config["kvd"]))
    llm = LLM(**kwargs)
    _reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("metrics"):
            ours = [m for m in llm.get_metrics() if m.name.startswith("vllm:kv_offload")]
            counters = {m.name: m.value for m in ours if hasattr(m, "value")}
            _reply({"metrics": counters})
            continue
        if cmd.get("reset_prefix_cache"):
            llm.reset_prefix_cache(reset_connector=bool(cmd.get("reset_connector")))
            _reply({"ok": True})
            continue
        params = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0.0)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in cmd["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        _reply({"tokens": tokens, "seconds": seconds})


def _reply(answer: dict[str, Any]) -> None:
    """One reply line in one write (print writes the newline apart: with
    PYTHONUNBUFFERED, another process's output could come in between)."""
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
