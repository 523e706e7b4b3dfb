"""The Llama family, tensor-parallel: composes the parallel layers; owns no collective itself.

Heads are split in contiguous groups of whole KV heads (each rank takes the query heads of its KV
heads), the MLP's intermediate size and the vocabulary in balanced contiguous ranges, so any
world size up to the number of KV heads works. Module and parameter names mirror the Hugging Face
checkpoint's, so the loader maps tensor names to parameters one to one. Each step's LoRA row groups
are built once here and handed to every projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from lorad.config import ModelConfig
from lorad.config.adapters import AdapterSpec
from lorad.config.partition import balanced_split, kv_head_range
from lorad.workers.attention import AttentionContext, paged_attention
from lorad.workers.batch import ForwardBatch
from lorad.workers.embedding import ParallelLMHead, VocabParallelEmbedding
from lorad.workers.kernel_path import kernel_path
from lorad.workers.kv_cache import PagedKVCache, kv_bytes_per_block
from lorad.workers.layers import RMSNorm, silu_and_mul
from lorad.workers.linear import ColumnParallelLinear, RowParallelLinear, projection_with_deltas
from lorad.workers.loader import load_adapter_weights, load_random_weights, load_weights
from lorad.workers.lora import LoraRows, add_lora_deltas
from lorad.workers.parallel import TensorParallel
from lorad.workers.rotary import RotaryEmbedding, apply_rotary
from lorad.workers.tuning import Tuning

if TYPE_CHECKING:  # a kernel module: the CPU path never imports triton
    from lorad.workers.kernels.lora_common import LoraDelta


@dataclass(frozen=True)
class RotaryInputs:
    """What every layer's rotary needs, built once per step: the torch path's per-row cos/sin
    ([num_rows, 1, head_dim] each), the fused kernel's tables and positions."""

    positions: torch.Tensor  # [num_rows] int64
    cos_table: torch.Tensor  # [max_positions, head_dim]
    sin_table: torch.Tensor
    cos: torch.Tensor | None  # torch path only
    sin: torch.Tensor | None

    @classmethod
    def build(cls, rotary_emb: RotaryEmbedding, positions: torch.Tensor) -> "RotaryInputs":
        cos = sin = None
        if not kernel_path(positions.device):
            cos, sin = rotary_emb(positions)
        return cls(positions, rotary_emb.cos_table, rotary_emb.sin_table, cos, sin)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, tuning: Tuning) -> None:
        super().__init__()
        d = config.head_dim
        g = config.queries_per_kv
        kv_start, kv_end = kv_head_range(config, tp.rank, tp.world_size)
        self.num_kv_heads = kv_end - kv_start
        self.num_q_heads = self.num_kv_heads * g
        self.head_dim = d
        self.scale = d ** -0.5
        hidden = config.hidden_size
        q_range = (kv_start * g * d, kv_end * g * d)
        kv_range = (kv_start * d, kv_end * d)
        # q, k and v stay separate modules (each has its own checkpoint tensor and LoRA
        # factors), but their weights are rows of one matrix, which CUDA multiplies at once.
        nq, nkv = self.num_q_heads * d, self.num_kv_heads * d
        self.qkv_sizes = (nq, nkv, nkv)
        self.qkv_weight = torch.empty(nq + 2 * nkv, hidden, dtype=dtype, device=device)
        wq, wk, wv = self.qkv_weight.split(self.qkv_sizes)
        self.q_proj = ColumnParallelLinear(hidden, config.num_attention_heads * d, q_range,
                                           dtype, device, storage=wq)
        self.k_proj = ColumnParallelLinear(hidden, config.num_key_value_heads * d, kv_range,
                                           dtype, device, storage=wk)
        self.v_proj = ColumnParallelLinear(hidden, config.num_key_value_heads * d, kv_range,
                                           dtype, device, storage=wv)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, hidden, q_range, tp,
                                        dtype, device)
        self.kv_cache: PagedKVCache | None = None
        self.tune(tuning)

    def tune(self, tuning: Tuning) -> None:
        """Keep this layer's part of the kernels' settings."""
        dtype = self.qkv_weight.dtype
        self.qkv_gemv = tuning.gemv.config("qkv", dtype)  # the kernel path's decode GEMV tile
        self.o_proj.gemv = tuning.gemv.config("o", dtype)
        self.decode_attention = tuning.attention

    def forward(self, x: torch.Tensor, rotary: "RotaryInputs", ctx: AttentionContext,
                lora: LoraRows) -> tuple[torch.Tensor, LoraDelta | None]:
        """x: [num_rows, hidden] -> ([num_rows, hidden], its LoRA delta or None): o_proj's sum
        over ranks, before its rounding to the model dtype (the residual add does it; see
        RowParallelLinear), and, where the LoRA kernels leave it to the residual add, o_proj's
        delta."""
        num_rows = x.shape[0]
        projs = (self.q_proj, self.k_proj, self.v_proj)
        loras = [p.lora for p in projs]
        assert self.kv_cache is not None, "allocate_kv_cache() before forward()"
        if kernel_path(x.device):
            # Lazily: the CPU never imports triton.
            from lorad.workers.attention_cuda import attend_cuda
            from lorad.workers.kernels.fused_ops import rotary_write_kv
            # One matmul and one LoRA shrink/expand pair for q, k and v beside it; their deltas
            # added by the rotary + cache write kernel.
            (q, k, v), deltas = projection_with_deltas(x, self.qkv_weight, self.qkv_sizes,
                                                       loras, lora, self.qkv_gemv)
            q = rotary_write_kv(q, k, v, rotary.positions, rotary.cos_table, rotary.sin_table,
                                ctx.slot_mapping, self.kv_cache.k, self.kv_cache.v,
                                self.num_q_heads, self.head_dim, deltas, lora.pdl_rows)
            # [num_rows, q_heads * d]
            attn = attend_cuda(q, self.kv_cache, ctx, self.scale, self.decode_attention,
                               lora.pdl_rows)
            return self.o_proj.forward_with_delta(attn, lora)
        q, k, v = add_lora_deltas(loras, [p(x) for p in projs], x, lora)
        q = q.view(num_rows, self.num_q_heads, self.head_dim)
        k = k.view(num_rows, self.num_kv_heads, self.head_dim)
        v = v.view(num_rows, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, rotary.cos, rotary.sin)
        k = apply_rotary(k, rotary.cos, rotary.sin)
        attn = paged_attention(q, k, v, self.kv_cache, ctx, self.scale)  # [num_rows, q_heads * d]
        return self.o_proj(attn, lora), None


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, tuning: Tuning) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        inter_range = balanced_split(inter, tp.world_size)[tp.rank]
        num_local = inter_range[1] - inter_range[0]
        # Like q/k/v: two modules whose weights are the halves of one matrix.
        self.gate_up_sizes = (num_local, num_local)
        self.gate_up_weight = torch.empty(2 * num_local, hidden, dtype=dtype, device=device)
        w_gate, w_up = self.gate_up_weight.split(num_local)
        self.gate_proj = ColumnParallelLinear(hidden, inter, inter_range, dtype, device,
                                              storage=w_gate)
        self.up_proj = ColumnParallelLinear(hidden, inter, inter_range, dtype, device,
                                            storage=w_up)
        self.down_proj = RowParallelLinear(inter, hidden, inter_range, tp, dtype, device)
        self.tune(tuning)

    def tune(self, tuning: Tuning) -> None:
        """Keep this layer's part of the kernels' settings."""
        dtype = self.gate_up_weight.dtype
        self.gate_up_gemv = tuning.gemv.config("gate_up", dtype)  # the kernel path's
        self.down_proj.gemv = tuning.gemv.config("down", dtype)

    def forward(self, x: torch.Tensor, lora: LoraRows) -> tuple[torch.Tensor, LoraDelta | None]:
        """x: [num_rows, hidden] -> ([num_rows, hidden], its LoRA delta or None): down_proj's
        sum over ranks, before its rounding to the model dtype (the residual add does it; see
        RowParallelLinear), and down_proj's delta where it is left to the residual add."""
        loras = [self.gate_proj.lora, self.up_proj.lora]
        if kernel_path(x.device):
            # One matmul and one LoRA shrink/expand pair for both beside it; their deltas added
            # by the silu * up kernel.
            (gate, up), deltas = projection_with_deltas(x, self.gate_up_weight,
                                                        self.gate_up_sizes, loras, lora,
                                                        self.gate_up_gemv)
            return self.down_proj.forward_with_delta(
                silu_and_mul(gate, up, deltas, lora.pdl_rows), lora)
        gate, up = add_lora_deltas(loras, [self.gate_proj(x), self.up_proj(x)], x, lora)
        return self.down_proj(silu_and_mul(gate, up), lora), None


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, tuning: Tuning) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, tp, dtype, device, tuning)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                                                device)
        self.mlp = LlamaMLP(config, tp, dtype, device, tuning)

    def forward(self, hidden: torch.Tensor | None, delta: torch.Tensor,
                delta_lora: LoraDelta | None, rotary: "RotaryInputs", ctx: AttentionContext,
                lora: LoraRows) -> tuple[torch.Tensor, torch.Tensor, LoraDelta | None]:
        """(residual stream, what the previous layer adds to it, that output's LoRA delta left
        to the residual add or None) -> the same after this layer. hidden is None before the
        first layer, whose delta is the embedding. The residual adds stay in the model dtype, as
        in transformers; each is fused with the norm after it."""
        hidden, x = self.input_layernorm.add_and_norm(delta, hidden, delta_lora, lora.pdl_rows)
        attn, attn_lora = self.self_attn(x, rotary, ctx, lora)
        hidden, x = self.post_attention_layernorm.add_and_norm(attn, hidden, attn_lora,
                                                               lora.pdl_rows)
        return (hidden, *self.mlp(x, lora))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, tuning: Tuning) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp,
                                                   dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp, dtype, device, tuning)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                          config.max_position_embeddings, dtype, device)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, tuning: Tuning = Tuning()) -> None:
        """tuning: the kernels' settings (the engine's), each layer keeping its part."""
        super().__init__()
        kv_head_range(config, tp.rank, tp.world_size)  # refuse a bad world size before allocating
        self.config = config
        self.tp = tp
        self.dtype = dtype
        self.device = device
        self.tuning = tuning
        self.model = LlamaModel(config, tp, dtype, device, tuning)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, config.tie_word_embeddings, dtype,
                                      device)
        self.block_size: int | None = None

    def tune(self, tuning: Tuning) -> None:
        """Hand every layer its part of `tuning` (the constructor's; benchmarks compare
        variants with it, capturing graphs again after)."""
        self.tuning = tuning
        for layer in self.model.layers:
            layer.self_attn.tune(tuning)
            layer.mlp.tune(tuning)

    def load_weights(self, model_dir: str) -> None:
        # A tied checkpoint may still carry lm_head.weight: the embedding's copy is the one used.
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        load_weights(self, model_dir, skip=skip)

    def load_random_weights(self, seed: int) -> None:
        """`--load-format random`: seeded random weights of the checkpoint's shapes."""
        load_random_weights(self, self.checkpoint_shapes(), seed)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's full (unsharded) shape in a checkpoint, by name."""
        params = dict(self.named_parameters())
        shapes = {}
        for name, module in self.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                shape = (module.out_features, module.in_features)
            elif isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
                shape = (module.vocab_size, module.hidden_size)
            elif isinstance(module, RMSNorm):
                shape = tuple(module.weight.shape)
            else:
                continue
            if f"{name}.weight" in params:  # a tied head's weight is the embedding's
                shapes[f"{name}.weight"] = shape
        return shapes

    def lora_target(self, layer: int, module: str) -> ColumnParallelLinear | RowParallelLinear:
        """The projection an adapter module (LoraModule.layer, .module) edits."""
        decoder = self.model.layers[layer]
        parent = decoder.mlp if module in ("gate_proj", "up_proj", "down_proj") else \
            decoder.self_attn
        return getattr(parent, module)

    def load_adapters(self, specs: tuple[AdapterSpec, ...]) -> None:
        """Give every edited projection its slot tables and load this rank's factor shards."""
        load_adapter_weights(self.lora_target, specs)

    @staticmethod
    def kv_cache_bytes_per_block(config: ModelConfig, tp_rank: int, world_size: int,
                                 block_size: int, dtype: torch.dtype) -> int:
        kv_start, kv_end = kv_head_range(config, tp_rank, world_size)
        return kv_bytes_per_block(config.num_hidden_layers, kv_end - kv_start, config.head_dim,
                                  block_size, dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.kv_cache = PagedKVCache(num_blocks, block_size, attn.num_kv_heads, attn.head_dim,
                                         self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, lora_launch_always: bool = False) -> torch.Tensor:
        """-> [num_sampled, vocab_size] float32 logits of batch.sample_rows, the same on every
        rank. lora_launch_always: capturing a CUDA graph that replays for any adapter mixture,
        so every edited projection launches its LoRA kernels whatever this batch's slots."""
        assert self.block_size is not None, "allocate_kv_cache() before forward()"
        ctx = AttentionContext.build(batch, self.block_size)
        rotary = RotaryInputs.build(self.model.rotary_emb, batch.positions)
        hidden, delta_lora = None, None
        delta = self.model.embed_tokens(batch.input_ids)  # [num_rows, hidden]
        # The step's LoRA rows (none edit in a base-only step) and its PDL row limit.
        lora = LoraRows.from_batch(batch, launch_always=lora_launch_always, tuning=self.tuning)
        for layer in self.model.layers:
            hidden, delta, delta_lora = layer(hidden, delta, delta_lora, rotary, ctx, lora)
        if kernel_path(delta.device):
            # The last residual add fused with the final norm, on every row (as cheap as
            # picking the rows first, and one kernel).
            _, normed = self.model.norm.add_and_norm(delta, hidden, delta_lora, lora.pdl_rows)
            normed = normed[batch.sample_rows]  # [num_sampled, hidden]
        else:
            rows = batch.sample_rows
            _, normed = self.model.norm.add_and_norm(delta[rows], hidden[rows])
        return self.lm_head(normed)
