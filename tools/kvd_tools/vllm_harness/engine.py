"""Runs in a vLLM engine process (tests, `kvd bench vllm`): one `vllm.LLM`, driven over stdin.

`python -m kvd_tools.vllm_harness.engine CONFIG_JSON` builds `vllm.LLM` on a model
directory that `write_model` wrote (a `config.json`, and random weights of a
realistic spread in `model.safetensors`: no hub, no tokenizer), optionally with
kvd's connector, then answers one JSON command per stdin line, on one stdout
line that starts with `{` (vLLM's own logs go to stderr: the driver sets
`VLLM_LOGGING_STREAM`):

    {"prompts": [[token ids], ...], "max_tokens": N, "logprobs": K}
        -> {"tokens": [[...], ...], "seconds": s,
            "logprobs": [[[[id, logprob], ...] a generated token] a prompt]}  (with K only)
    {"reset_prefix_cache": true}                       -> {"ok": true}
    {"reset_prefix_cache": true, "reset_connector": true}  -> {"ok": true} (the connector's too)
    {"metrics": true}      -> {"metrics": {name: value}}, vLLM's `vllm:kv_offload*` counters
    {"metrics": true, "prefixes": [...]}  -> the same, for metrics of these name prefixes
    {"prompts": [...], "max_tokens": N, "timings": true}  -> also "timings": per prompt
        [seconds to its first token, seconds a later token took (null for one token),
        seconds from queued to first scheduled, from scheduled to its first token]
    {"prompts": [...], "abort": S, "max_tokens": N}  -> {"aborted": n}: the requests
        added, S engine steps run, those still running aborted (`_abort`)

Why weights: with vLLM's dummy weights (uniform in +-1e-3, norm gains too) the
tokens hardly depend on the KV cache, so "the same tokens as without kvd"
held even with every page kvd loaded zeroed. `write_model` draws linear
layers at 1/sqrt(fan-in), norm gains at 1: the logprobs then move with the
bytes of every page.

CONFIG_JSON keys: `model` (a directory), `kvd` (extra-config keys, or null for
no connector), and optional `kv_transfer` (a whole `KVTransferConfig`, another
connector than kvd's: `kvd bench peers` runs LMCache's), `tp`, `max_model_len`,
`num_gpu_blocks` (vLLM's `num_gpu_blocks_override`), `dtype`, `load_format` (default:
"safetensors" where the directory holds weights, else "dummy"), and
`corrupt_loads` (true: every page kvd loads is zeroed after its copy, see
`corrupt_loads`; the check that a comparison can fail) or `hook_times` (a
directory: each process's time in kvd's hooks, see `hook_times`). vLLM spawns
processes of its own, so everything runs under `__main__`.
"""

from __future__ import annotations

import json
import os
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
# A tiny Gemma 3 text model: 3 sliding-window layers (window 128) and 1 full
# attention layer, so vLLM makes 4 KV cache groups (3 sliding, 1 full).
TINY_GEMMA3: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "sliding_window": 128,
    "query_pre_attn_scalar": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# A tiny gpt-oss: sliding-window (128) and full attention layers alternating,
# with attention sinks and biases, and a mixture of 4 experts (2 a token).
TINY_GPT_OSS: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32


WEIGHTS_FILE = "model.safetensors"


def write_model(
    directory: Path, config: dict[str, Any] = TINY_LLAMA, *, weights: bool = True, seed: int = 0
) -> str:
    """A model directory: `config.json`, and unless `weights` is false, weights drawn
    from `seed` (`weight_shapes`) that vLLM loads as a checkpoint's."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if weights:
        write_weights(directory / WEIGHTS_FILE, config, seed)
    return str(directory)


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors of a dense Llama, Gemma 3 (text), DeepSeek-V2 (MLA, no
    q LoRA, no MoE layer) or gpt-oss (bf16 experts, not MXFP4), by their Hugging Face
    names, as vLLM's loaders read them."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    ff = config["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        at = f"model.layers.{i}."
        attn: dict[str, tuple[int, ...]]
        if config["model_type"] in ("llama", "gemma3_text"):
            heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
            d = config.get("head_dim", h // heads)
            attn = {"q_proj": (heads * d, h), "k_proj": (kv_heads * d, h),
                    "v_proj": (kv_heads * d, h), "o_proj": (h, heads * d)}  # fmt: skip
        elif config["model_type"] == "gpt_oss":
            heads, kv_heads, d = (config["num_attention_heads"], config["num_key_value_heads"],
                                  config["head_dim"])  # fmt: skip
            attn = {"q_proj": (heads * d, h), "k_proj": (kv_heads * d, h),
                    "v_proj": (kv_heads * d, h), "o_proj": (h, heads * d)}  # fmt: skip
            for n, s in list(attn.items()):
                shapes[f"{at}self_attn.{n}.bias"] = (s[0],)
            shapes[f"{at}self_attn.sinks"] = (heads,)
            experts = config["num_local_experts"]
            shapes.update({
                f"{at}mlp.router.weight": (experts, h), f"{at}mlp.router.bias": (experts,),
                f"{at}mlp.experts.gate_up_proj": (experts, h, 2 * ff),
                f"{at}mlp.experts.gate_up_proj_bias": (experts, 2 * ff),
                f"{at}mlp.experts.down_proj": (experts, ff, h),
                f"{at}mlp.experts.down_proj_bias": (experts, h),
            })  # fmt: skip
        elif config["model_type"] == "deepseek_v2":
            if config.get("q_lora_rank") is not None or config["first_k_dense_replace"] < layers:
                raise ValueError("weight_shapes: a DeepSeek-V2 with q LoRA or MoE layers")
            heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
            nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
            v = config["v_head_dim"]
            attn = {"q_proj": (heads * (nope + rope), h),
                    "kv_a_proj_with_mqa": (rank + rope, h), "kv_a_layernorm": (rank,),
                    "kv_b_proj": (heads * (nope + v), rank), "o_proj": (h, heads * v)}  # fmt: skip
        else:
            raise ValueError(f"weight_shapes: no weights for model_type {config['model_type']!r}")
        shapes.update({f"{at}self_attn.{n}.weight": s for n, s in attn.items()})
        if config["model_type"] != "gpt_oss":  # its MLP is the experts
            mlp = {"gate_proj": (ff, h), "up_proj": (ff, h), "down_proj": (h, ff)}
            shapes.update({f"{at}mlp.{n}.weight": s for n, s in mlp.items()})
        shapes[f"{at}input_layernorm.weight"] = (h,)
        shapes[f"{at}post_attention_layernorm.weight"] = (h,)
        if config["model_type"] == "gemma3_text":  # per-head q/k norms, norms around the MLP
            shapes[f"{at}self_attn.q_norm.weight"] = (d,)
            shapes[f"{at}self_attn.k_norm.weight"] = (d,)
            shapes[f"{at}pre_feedforward_layernorm.weight"] = (h,)
            shapes[f"{at}post_feedforward_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def write_weights(path: Path, config: dict[str, Any], seed: int = 0) -> None:
    """Seeded weights of a realistic spread: norm gains 1, embeddings N(0, 1), every
    matrix N(0, 1/fan-in), so each layer's output is of the size of its input,
    attention scores spread over about one unit and the logits over a few."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, config.get("torch_dtype", "bfloat16"))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith(("bias", "sinks")):  # gpt-oss's: 0 (a sink of logit 0)
            tensors[name] = torch.zeros(shape, dtype=dtype)
            continue
        if len(shape) == 1:  # an RMSNorm's gain; Gemma's scales by 1 + weight
            gemma = config["model_type"].startswith("gemma")
            tensors[name] = (torch.zeros if gemma else torch.ones)(shape, dtype=dtype)
            continue
        # Gemma scales its embeddings by sqrt(hidden) and ties them to the logits:
        # N(0, 1/hidden) gives hidden states of size 1 and logits spread over a unit.
        embed = name == "model.embed_tokens.weight" and not config["model_type"].startswith("gemma")
        std = 1.0 if embed else shape[1] ** -0.5
        tensors[name] = (torch.randn(shape, generator=generator) * std).to(dtype)
    save_file(tensors, str(path))


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

    weights = (Path(config["model"]) / WEIGHTS_FILE).exists()
    kwargs: dict[str, Any] = {
        "model": config["model"],
        "load_format": config.get("load_format") or ("safetensors" if weights else "dummy"),
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
        transfer = kv_transfer_config(config["kvd"])
        if config.get("corrupt_loads"):  # the same connector, its worker's loads zeroed
            transfer["kv_connector_module_path"] = "kvd_tools.vllm_harness.corrupt_loads"
        elif config.get("hook_times"):  # the same connector, its hooks timed
            os.environ["KVD_HOOK_TIMES"] = str(config["hook_times"])  # for vLLM's children
            transfer["kv_connector_module_path"] = "kvd_tools.vllm_harness.hook_times"
        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
    elif config.get("kv_transfer") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**config["kv_transfer"])
    llm = LLM(**kwargs)
    _reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("metrics"):
            prefixes = tuple(cmd.get("prefixes") or ["vllm:kv_offload"])
            ours = [m for m in llm.get_metrics() if m.name.startswith(prefixes)]
            counters = {m.name: m.value for m in ours if hasattr(m, "value")}
            _reply({"metrics": counters})
            continue
        if cmd.get("reset_prefix_cache"):
            llm.reset_prefix_cache(reset_connector=bool(cmd.get("reset_connector")))
            _reply({"ok": True})
            continue
        if cmd.get("abort") is not None:
            _reply({"aborted": _abort(llm, cmd, TokensPrompt, SamplingParams)})
            continue
        top = cmd.get("logprobs")
        params = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0.0, logprobs=top)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in cmd["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        answer: dict[str, Any] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "seconds": seconds,
        }
        if top is not None:
            answer["logprobs"] = [[_top(position) for position in o.outputs[0].logprobs or []]
                                  for o in outs]  # fmt: skip
        if cmd.get("timings"):
            answer["timings"] = [_timings(o) for o in outs]
        _reply(answer)


def _abort(llm: Any, cmd: dict[str, Any], prompt_type: Any, params_type: Any) -> int:
    """Adds `prompts`, runs `abort` engine steps, aborts the requests still running,
    then steps until the engine has nothing left; returns how many were aborted."""
    engine = llm.llm_engine
    params = params_type(max_tokens=cmd.get("max_tokens", 64), temperature=0.0)
    ids = [f"abort-{time.monotonic_ns()}-{n}" for n in range(len(cmd["prompts"]))]
    for request_id, tokens in zip(ids, cmd["prompts"], strict=True):
        engine.add_request(request_id, prompt_type(prompt_token_ids=tokens), params)
    finished: set[str] = set()
    for _ in range(int(cmd["abort"])):
        finished.update(o.request_id for o in engine.step() if o.finished)
    running = [i for i in ids if i not in finished]
    engine.abort_request(running)
    while engine.has_unfinished_requests():
        engine.step()
    return len(running)


def _timings(out: Any) -> list[float | None]:
    """[first token latency, seconds a token after it, queued to first scheduled,
    scheduled to first token] from vLLM's per-request stats (engine core
    timestamps; kept because the engine logs stats). A request that waited for
    a connector's asynchronous load is first scheduled after it: its wait is in
    the third figure, its forward pass in the fourth."""
    stats = out.metrics
    if stats is None:
        return [None, None, None, None]
    later = stats.num_generation_tokens - 1
    step = (stats.last_token_ts - stats.first_token_ts) / later if later > 0 else None
    return [stats.first_token_latency, step, stats.scheduled_ts - stats.queued_ts,
            stats.first_token_ts - stats.scheduled_ts]  # fmt: skip


def _top(position: Any) -> list[tuple[int, float]]:
    """One generated token's logprobs: [id, logprob] pairs, the likeliest first (the
    top K, and the token chosen where it is not among them)."""
    pairs = [(int(i), float(lp.logprob)) for i, lp in position.items()]
    return sorted(pairs, key=lambda pair: -pair[1])


def _reply(answer: dict[str, Any]) -> None:
    """One reply line in one write (print writes the newline apart: with
    PYTHONUNBUFFERED, another process's output could come in between)."""
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
