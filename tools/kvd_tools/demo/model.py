"""Runs in a demo TP worker (and in unit tests at TP=1): a small decoder over a paged KV cache.

A decoder-only transformer with random weights drawn from a fixed seed, fp32,
Megatron-style tensor parallel: the query/key/value (or latent up-) projections
and the MLP up projection are split by columns (heads), the attention output
and MLP down projections by rows, and one all-reduce follows each of the two
row-parallel projections. Every rank draws the full weights from the same seed
and keeps its shard, so TP=1 and TP=2 compute the same model.

The KV cache is paged in blocks of `block_tokens` tokens; one tensor per rank,
all layers of a block contiguous (the layout `kvd_client.Worker` copies whole):

    mha: [num_blocks, num_layers, 2 (K, V), block_tokens, local_heads, head_dim]
         each rank holds its own heads: a sharded kvd pool
    mla: [num_blocks, num_layers, block_tokens, latent_dim + rope_dim]
         the compressed latent (and the shared rotary key) is the same on every
         rank: a replicated kvd pool, rank 0 stores it, every rank loads it
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Variant = Literal["mha", "mla"]
AllReduce = Callable[[torch.Tensor], None]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    variant: Variant = "mha"
    vocab: int = 4096
    hidden: int = 512
    num_layers: int = 4
    num_heads: int = 8
    # Query, key and value heads are all head_dim wide: torch's CPU flash
    # attention needs equal widths (else a 10x slower fallback), so an mla
    # query/key head is head_dim - rope_dim latent-derived dims + rope_dim rotary.
    head_dim: int = 64
    ffn: int = 2048
    latent_dim: int = 128  # mla: compressed KV per token and layer
    rope_dim: int = 16  # mla: the rotary key, shared by all heads
    block_tokens: int = 16
    max_positions: int = 16_384 + 512
    seed: int = 1234

    @property
    def identity(self) -> str:
        """Names the model and its weights: the kvd pool's `Layout.model` and the hash root."""
        return (
            f"kvd-demo-{self.variant}-v{self.vocab}-d{self.hidden}-l{self.num_layers}"
            f"-h{self.num_heads}x{self.head_dim}-f{self.ffn}-r{self.latent_dim}+{self.rope_dim}"
            f"-s{self.seed}"
        )


def cache_shape(config: ModelConfig, world_size: int, num_blocks: int) -> tuple[int, ...]:
    """The shape of one rank's KV cache tensor (see the module docstring)."""
    c = config
    if c.variant == "mla":
        return (num_blocks, c.num_layers, c.block_tokens, c.latent_dim + c.rope_dim)
    heads = c.num_heads // world_size
    return (num_blocks, c.num_layers, 2, c.block_tokens, heads, c.head_dim)


def slot_bytes(config: ModelConfig, world_size: int) -> int:
    """Bytes one rank contributes per block, all layers (fp32): `Layout.slot_bytes`."""
    return math.prod(cache_shape(config, world_size, 1)) * 4


def _rope_table(max_positions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A table, not cos/sin per call: a position gets the same bits whatever the
    # batch, so a cached prefix and a recompute rotate identically.
    inv = 1.0 / (10_000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().float(), angles.sin().float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half) of x [n, ..., dim] with cos/sin [n, dim/2]."""
    half = x.shape[-1] // 2
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Draw:
    """Draws full weight matrices in a fixed order from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=self.gen) / math.sqrt(rows)


class Layer:
    """One block's weights, this rank's shard: column-parallel in, row-parallel out."""

    def __init__(self, c: ModelConfig, draw: _Draw, rank: int, world_size: int) -> None:
        heads = c.num_heads // world_size
        h0, h1 = rank * heads, (rank + 1) * heads
        f0, f1 = rank * c.ffn // world_size, (rank + 1) * c.ffn // world_size
        cols = slice(h0 * c.head_dim, h1 * c.head_dim)  # this rank's heads
        self.wq = draw(c.hidden, c.num_heads * c.head_dim)[:, cols].contiguous()
        if c.variant == "mha":
            self.wk = draw(c.hidden, c.num_heads * c.head_dim)[:, cols].contiguous()
            self.wv = draw(c.hidden, c.num_heads * c.head_dim)[:, cols].contiguous()
        else:
            # Down-projection to the latent: replicated, so both ranks compute
            # the same latent bit for bit (what a replicated pool relies on).
            self.wkv_down = draw(c.hidden, c.latent_dim + c.rope_dim)
            nope = c.head_dim - c.rope_dim
            k_cols = slice(h0 * nope, h1 * nope)
            self.wk_up = draw(c.latent_dim, c.num_heads * nope)[:, k_cols].contiguous()
            self.wv_up = draw(c.latent_dim, c.num_heads * c.head_dim)[:, cols].contiguous()
        self.wo = draw(c.num_heads * c.head_dim, c.hidden)[cols].contiguous()
        self.w_up = draw(c.hidden, c.ffn)[:, f0:f1].contiguous()
        self.w_down = draw(c.ffn, c.hidden)[f0:f1].contiguous()


class ShardedModel:
    """Rank `rank` of `world_size` of the demo model; `all_reduce` sums across ranks in place."""

    def __init__(
        self,
        config: ModelConfig,
        rank: int = 0,
        world_size: int = 1,
        all_reduce: AllReduce | None = None,
    ) -> None:
        if config.num_heads % world_size or config.ffn % world_size:
            raise ValueError(f"heads and ffn must divide by world_size {world_size}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.heads = config.num_heads // world_size
        self.all_reduce: AllReduce = all_reduce or (lambda _t: None)
        draw = _Draw(config.seed)
        self.embed = draw(config.vocab, config.hidden) * math.sqrt(config.vocab)
        self.layers = [Layer(config, draw, rank, world_size) for _ in range(config.num_layers)]
        self.lm_head = draw(config.hidden, config.vocab)
        rope_dim = config.head_dim if config.variant == "mha" else config.rope_dim
        self.cos, self.sin = _rope_table(config.max_positions, rope_dim)

    def make_cache(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(cache_shape(self.config, self.world_size, num_blocks))

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, start: int, block_table: torch.Tensor, cache: torch.Tensor
    ) -> torch.Tensor:
        """Runs `tokens` at positions start.. and returns the last position's logits [vocab].

        Writes their KV into `cache` at the blocks of `block_table` (device
        block ids, in prompt order) and attends over positions 0..end, so
        positions before `start` must already be in the cache (computed, or
        loaded from kvd).
        """
        c = self.config
        n, end = tokens.numel(), start + tokens.numel()
        if end > c.max_positions or end > block_table.numel() * c.block_tokens:
            raise ValueError(f"{end} positions exceed the model or the block table")
        pos = torch.arange(start, end)
        write = (block_table[pos // c.block_tokens], pos % c.block_tokens)
        read = block_table[: (end + c.block_tokens - 1) // c.block_tokens]
        cos, sin = self.cos[start:end], self.sin[start:end]
        mask = None
        if start > 0 and 1 < n <= end // 2:
            # Lower-right causal: query i (position start+i) sees keys 0..start+i.
            # (More new tokens than cached ones take the padded path of _attend.)
            mask = torch.ones(n, end, dtype=torch.bool).tril(start)
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x)
            if c.variant == "mha":
                attn = self._mha(layer, cache[:, i], h, start, write, read, cos, sin, mask)
            else:
                attn = self._mla(layer, cache[:, i], h, start, write, read, cos, sin, mask)
            out = attn @ layer.wo
            self.all_reduce(out)
            x = x + out
            up = F.gelu(_rms_norm(x) @ layer.w_up, approximate="tanh")
            down = up @ layer.w_down
            self.all_reduce(down)
            x = x + down
        return _rms_norm(x[-1]) @ self.lm_head

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [n, heads, dq], k [end, heads, dq], v [end, heads, dv] -> [n, heads * dv].

        The queries are the last n positions: causal, aligned to the bottom right.
        """
        n, end = q.shape[0], k.shape[0]
        if mask is None and 1 < n < end:
            # Pad the queries in front to a square and take the causal kernel,
            # which skips the masked half: a mask makes the kernel visit every
            # pair of the n x end rectangle, dearer once n > end / 2.
            q = torch.cat((q.new_zeros(end - n, *q.shape[1:]), q))
        causal = mask is None and n > 1
        # 4-d [1, heads, tokens, dim]: torch's CPU flash kernel takes only 4-d
        # inputs; 3-d falls back to the quadratic-memory math path (10x slower).
        qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal)
        return out[0, :, -n:].transpose(0, 1).reshape(n, -1)

    def _mha(
        self,
        layer: Layer,
        cache: torch.Tensor,
        h: torch.Tensor,
        start: int,
        write: tuple[torch.Tensor, torch.Tensor],
        read: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        c, n = self.config, h.shape[0]
        q = _rotate((h @ layer.wq).view(n, self.heads, c.head_dim), cos, sin)
        k = _rotate((h @ layer.wk).view(n, self.heads, c.head_dim), cos, sin)
        v = (h @ layer.wv).view(n, self.heads, c.head_dim)
        cache[:, 0][write] = k
        cache[:, 1][write] = v
        if start > 0:  # the prefix comes from the paged cache
            end = start + n
            k = cache[:, 0][read].flatten(0, 1)[:end]
            v = cache[:, 1][read].flatten(0, 1)[:end]
        return self._attend(q, k, v, mask)

    def _mla(
        self,
        layer: Layer,
        cache: torch.Tensor,
        h: torch.Tensor,
        start: int,
        write: tuple[torch.Tensor, torch.Tensor],
        read: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        c, n = self.config, h.shape[0]
        nope = c.head_dim - c.rope_dim
        q = (h @ layer.wq).view(n, self.heads, c.head_dim)
        q = torch.cat((q[..., :nope], _rotate(q[..., nope:], cos, sin)), dim=-1)
        down = h @ layer.wkv_down
        latent = torch.cat(
            (_rms_norm(down[:, : c.latent_dim]), _rotate(down[:, c.latent_dim :], cos, sin)), dim=-1
        )
        cache[write] = latent
        if start > 0:
            latent = cache[read].flatten(0, 1)[: start + n]
        kv, k_rope = latent[:, : c.latent_dim], latent[:, c.latent_dim :]
        m = kv.shape[0]
        k = torch.cat(
            (
                (kv @ layer.wk_up).view(m, self.heads, nope),
                k_rope.unsqueeze(1).expand(m, self.heads, c.rope_dim),
            ),
            dim=-1,
        )
        v = (kv @ layer.wv_up).view(m, self.heads, c.head_dim)
        return self._attend(q, k, v, mask)
