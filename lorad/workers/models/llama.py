"""The Llama family, tensor-parallel: composes the parallel layers; owns no collective itself.

Heads are split in contiguous groups of whole KV heads (each rank takes the query heads of its KV
heads), the MLP's intermediate size and the vocabulary in balanced contiguous ranges, so any
world size up to the number of KV heads works. Module names mirror the Hugging Face checkpoint's,
except the fused projections (qkv_proj, gate_up_proj), whose parts take the checkpoint's
q/k/v_proj and gate/up_proj tensors (weight_targets). Each step's LoRA rows are built once here
and handed to every layer; the layers choose between the kernel and the torch path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from lorad.config import ModelConfig
from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import AdapterSpec
from lorad.config.partition import balanced_split, kv_head_range
from lorad.workers.attention import AttentionContext
from lorad.workers.batch import ForwardBatch
from lorad.workers.embedding import ParallelLMHead, VocabParallelEmbedding
from lorad.workers.kernel_path import kernel_path
from lorad.workers.kv_cache import PagedKVCache, kv_bytes_per_block
from lorad.workers.layers import RMSNorm
from lorad.workers.fused_linear import (FusedColumnParallelLinear, FusedPart,
                                        MergedColumnParallelLinear, QKVParallelLinear)
from lorad.workers.linear import RowParallelLinear
from lorad.workers.loader import (add_adapter_tables, load_adapter_weights, load_random_weights,
                                  load_weights)
from lorad.workers.lora_rows import LoraRows
from lorad.workers.parallel import TensorParallel
from lorad.workers.rotary import RotaryEmbedding
from lorad.workers.rotary_attention import RotaryInputs, RotaryPagedAttention
from lorad.workers.tuning import Tuning

if TYPE_CHECKING:  # a kernel module: the CPU path never imports triton
    from lorad.workers.kernels.configs import MatmulTiles
    from lorad.workers.kernels.lora_common import LoraDelta


# A fused projection's part -> the fused projection's name in its decoder layer's block.
FUSED_OF = {"q": "qkv_proj", "k": "qkv_proj", "v": "qkv_proj", "gate": "gate_up_proj",
            "up": "gate_up_proj"}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, tuning: Tuning) -> None:
        super().__init__()
        d, hidden = config.head_dim, config.hidden_size
        kv_start, kv_end = kv_head_range(config, tp.rank, tp.world_size)
        num_kv_heads = kv_end - kv_start
        self.qkv_proj = QKVParallelLinear(hidden, d, config.num_attention_heads,
                                          config.num_key_value_heads, (kv_start, kv_end), dtype,
                                          device, bias=config.qkv_bias)
        self.attn = RotaryPagedAttention(num_kv_heads * config.queries_per_kv, num_kv_heads, d)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, hidden,
                                        self.qkv_proj.parts["q"][1], tp, dtype, device)
        self.tune(tuning)

    @property
    def kv_cache(self) -> PagedKVCache | None:
        return self.attn.kv_cache

    def tune(self, tuning: Tuning) -> None:
        """Hand each layer its part of the kernels' settings."""
        dtype = self.qkv_proj.weight.dtype
        self.qkv_proj.gemv = tuning.gemv.config("qkv", dtype)
        self.o_proj.gemv = tuning.gemv.config("o", dtype)
        self.attn.decode = tuning.attention

    def forward(self, x: torch.Tensor, rotary: RotaryInputs, ctx: AttentionContext,
                lora: LoraRows) -> tuple[torch.Tensor, LoraDelta | None]:
        """x: [num_rows, hidden] -> ([num_rows, hidden], its LoRA delta or None): o_proj's sum
        over ranks, before its rounding to the model dtype (the residual add does it; see
        RowParallelLinear), and o_proj's delta where the LoRA kernels leave it to that add."""
        (q, k, v), deltas = self.qkv_proj(x, lora)
        attn = self.attn(q, k, v, deltas, rotary, ctx, lora.pdl_rows)  # [num_rows, q_heads * d]
        return self.o_proj.forward_with_delta(attn, lora)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, tuning: Tuning) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        inter_range = balanced_split(inter, tp.world_size)[tp.rank]
        self.gate_up_proj = MergedColumnParallelLinear(hidden, inter, inter_range, dtype, device)
        self.down_proj = RowParallelLinear(inter, hidden, inter_range, tp, dtype, device)
        self.tune(tuning)

    def tune(self, tuning: Tuning) -> None:
        """Hand each layer its part of the kernels' settings."""
        dtype = self.gate_up_proj.weight.dtype
        self.gate_up_proj.gemv = tuning.gemv.config("gate_up", dtype)
        self.gate_up_proj.swiglu_epilogue = tuning.gemv.swiglu_epilogue
        self.down_proj.gemv = tuning.gemv.config("down", dtype)

    def forward(self, x: torch.Tensor, lora: LoraRows, ctx: AttentionContext | None = None
                ) -> tuple[torch.Tensor, LoraDelta | None]:
        """x: [num_rows, hidden] -> ([num_rows, hidden], its LoRA delta or None): down_proj's
        sum over ranks, before its rounding to the model dtype (the residual add does it; see
        RowParallelLinear), and down_proj's delta where it is left to the residual add. ctx
        (the step's, as an MoE block takes it) is not read: padding rows cost a dense MLP no
        more bytes."""
        return self.down_proj.forward_with_delta(self.gate_up_proj.swiglu(x, lora), lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, tuning: Tuning, mlp: nn.Module | None = None) -> None:
        """mlp: another family's block in place of the dense MLP (Qwen2-MoE's sparse block);
        its forward(x, lora, ctx) returns what LlamaMLP's does."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, tp, dtype, device, tuning)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                                                device)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, tp, dtype, device, tuning)

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
        return (hidden, *self.mlp(x, lora, ctx))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, tuning: Tuning,
                 mlp_of: Callable[[int], nn.Module | None] = lambda layer: None) -> None:
        """mlp_of(layer): that decoder layer's block in place of the dense MLP, or None."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp,
                                                   dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp, dtype, device, tuning, mlp_of(i))
                                    for i in range(config.num_hidden_layers))
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
        self.model = LlamaModel(config, tp, dtype, device, tuning, self.layer_mlp)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, config.tie_word_embeddings, dtype,
                                      device)
        self.block_size: int | None = None

    def layer_mlp(self, layer: int) -> nn.Module | None:
        """Decoder layer `layer`'s block in place of the dense MLP: none in the Llama family (a
        family's model file overrides this)."""
        return None

    def tune(self, tuning: Tuning) -> None:
        """Hand every layer its part of `tuning` (the constructor's; benchmarks compare
        variants with it, capturing graphs again after)."""
        self.tuning = tuning
        for layer in self.model.layers:
            layer.self_attn.tune(tuning)
            layer.mlp.tune(tuning)

    def plan_matmuls(self, max_rows: int) -> dict:
        """On the kernel path, before any graph is captured: measure where cuBLAS keeps a row's
        bits for every base projection and the LM head, products of 1..max_rows rows
        (matmul_plan.py), and hand each layer its plans. -> the plans by (shape, dtype,
        out_dtype)."""
        return plan_module_matmuls(self, max_rows, self.tuning.matmul)

    def load_weights(self, model_dir: str) -> None:
        # A tied checkpoint may still carry lm_head.weight: the embedding's copy is the one used.
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        load_weights(self, model_dir, skip=skip)

    def load_random_weights(self, seed: int) -> None:
        """`--load-format random`: seeded random weights of the checkpoint's shapes."""
        load_random_weights(self, self.checkpoint_shapes(), seed)

    def weight_targets(self) -> dict[str, tuple[nn.Parameter, str | None]]:
        """Checkpoint tensor name -> (the parameter holding this rank's shard of it, its part of
        a fused weight or None): q/k/v_proj.weight go to qkv_proj's parts q, k and v, gate/up to
        gate_up_proj's; every other parameter has its checkpoint name."""
        targets, fused = {}, set()
        for name, module in self.named_modules():
            if isinstance(module, FusedColumnParallelLinear):
                parent = name.rpartition(".")[0]
                fused.update({f"{name}.weight", f"{name}.bias"})
                for shard_id in module.parts:
                    targets[f"{parent}.{shard_id}_proj.weight"] = (module.weight, shard_id)
                    if module.bias is not None:
                        targets[f"{parent}.{shard_id}_proj.bias"] = (module.bias, shard_id)
        for name, param in self.named_parameters():
            if name not in fused:
                targets[name] = (param, None)
        return targets

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> this rank's shard of it: the parameter, or a view of its
        part of a fused weight (what the loader filled)."""
        return {name: param if shard_id is None else self.shard_view(name, shard_id)
                for name, (param, shard_id) in self.weight_targets().items()}

    def shard_view(self, name: str, shard_id) -> torch.Tensor:
        """The view of a fused parameter that checkpoint tensor `name` fills (its part)."""
        owner = self.get_submodule(name.rpartition(".")[0].rpartition(".")[0])
        fused = getattr(owner, FUSED_OF[shard_id])
        return fused.part_bias(shard_id) if name.endswith(".bias") else \
            fused.part_weight(shard_id)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor's full (unsharded) shape, by name."""
        params = dict(self.named_parameters())
        shapes = {}
        for name, module in self.named_modules():
            if isinstance(module, FusedColumnParallelLinear):
                parent = name.rpartition(".")[0]
                for shard_id, (full, _) in module.parts.items():
                    shapes[f"{parent}.{shard_id}_proj.weight"] = (full, module.in_features)
                    if module.bias is not None:
                        shapes[f"{parent}.{shard_id}_proj.bias"] = (full,)
                continue
            if isinstance(module, RowParallelLinear):
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

    def lora_target(self, layer: int, module: str) -> FusedPart | RowParallelLinear:
        """What an adapter module (LoraModule.layer, .module) edits: o_proj or down_proj, or a
        part of qkv_proj or gate_up_proj; its add_lora_slots gives it its slot tables."""
        decoder = self.model.layers[layer]
        if module in ("o_proj", "down_proj"):
            return decoder.self_attn.o_proj if module == "o_proj" else decoder.mlp.down_proj
        fused = decoder.mlp.gate_up_proj if module in ("gate_proj", "up_proj") else \
            decoder.self_attn.qkv_proj
        return fused.part(module.removesuffix("_proj"))

    def load_adapters(self, specs: tuple[AdapterSpec, ...]) -> None:
        """Give every edited projection its slot tables and load this rank's factor shards
        (adapter i in slot i)."""
        load_adapter_weights(self.lora_target, specs)

    def add_lora_tables(self, specs: tuple[AdapterSpec, ...], capacity: LoraCapacity) -> dict:
        """Empty slot tables for `capacity` (loader.add_adapter_tables) -> {(layer, module):
        LoraSlots}; adapter_store.py fills their slots."""
        return add_adapter_tables(self.lora_target, specs, capacity, self.config)

    @staticmethod
    def kv_cache_bytes_per_block(config: ModelConfig, tp_rank: int, world_size: int,
                                 block_size: int, dtype: torch.dtype) -> int:
        kv_start, kv_end = kv_head_range(config, tp_rank, world_size)
        return kv_bytes_per_block(config.num_hidden_layers, kv_end - kv_start, config.head_dim,
                                  block_size, dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        for layer in self.model.layers:
            attn = layer.self_attn.attn
            attn.kv_cache = PagedKVCache(num_blocks, block_size, attn.num_kv_heads, attn.head_dim,
                                         self.dtype, self.device)

    def kv_caches(self) -> list[PagedKVCache]:
        """Every layer's KV cache, in layer order (allocate_kv_cache() first)."""
        return [layer.self_attn.kv_cache for layer in self.model.layers]

    @torch.inference_mode()
    def copy_kv_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) KV block, K and V, in every layer."""
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        for cache in self.kv_caches():
            cache.copy_blocks(src, dst)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, lora_launch_always: bool = False,
                hidden_rows: torch.Tensor | None = None):
        """-> [num_sampled, vocab_size] float32 logits of batch.sample_rows, the same on every
        rank. lora_launch_always: capturing a CUDA graph that replays for any adapter mixture,
        so every edited projection launches its LoRA kernels whatever this batch's slots.
        hidden_rows: [n] int64 more rows, whose final (normed) hidden states [n, hidden] come
        back beside the logits, as (logits, hidden): echo's (workers/prompt_logprobs.py)."""
        if kernel_path(batch.input_ids.device):
            normed = self.final_hidden(batch, lora_launch_always)
            extra = normed[hidden_rows] if hidden_rows is not None else None
            logits = self.lm_head(normed[batch.sample_rows])  # [num_sampled, hidden] in
            return logits if hidden_rows is None else (logits, extra)
        hidden, delta, _, _ = self.run_layers(batch)
        rows = batch.sample_rows
        _, normed = self.model.norm.add_and_norm(delta[rows], hidden[rows])
        if hidden_rows is not None:  # apart: the sampled rows' arithmetic stays as it was
            _, extra = self.model.norm.add_and_norm(delta[hidden_rows], hidden[hidden_rows])
        logits = self.lm_head(normed)
        return logits if hidden_rows is None else (logits, extra)

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch, lora_launch_always: bool = False,
                     ctx: AttentionContext | None = None) -> torch.Tensor:
        """Kernel path: [num_rows, hidden] every row's final normed hidden state (the LM head's
        input); the last residual add is fused with the final norm, on every row (as cheap as
        picking the rows first, and one kernel). ctx: the step's attention context, built
        before (a graph capture builds it outside the capture); None: built here."""
        hidden, delta, delta_lora, lora = self.run_layers(batch, lora_launch_always, ctx)
        _, normed = self.model.norm.add_and_norm(delta, hidden, delta_lora, lora.pdl_rows)
        return normed

    def run_layers(self, batch: ForwardBatch, lora_launch_always: bool = False,
                   ctx: AttentionContext | None = None):
        """Every decoder layer over the batch -> (residual stream, what the last layer adds to
        it, that output's LoRA delta or None, the step's LoraRows)."""
        assert self.block_size is not None, "allocate_kv_cache() before forward()"
        ctx = ctx if ctx is not None else AttentionContext.build(batch, self.block_size)
        rotary = RotaryInputs.build(self.model.rotary_emb, batch.positions)
        hidden, delta_lora = None, None
        delta = self.model.embed_tokens(batch.input_ids)  # [num_rows, hidden]
        # The step's LoRA rows (none edit in a base-only step) and its PDL row limit.
        lora = LoraRows.from_batch(batch, launch_always=lora_launch_always, tuning=self.tuning)
        for layer in self.model.layers:
            hidden, delta, delta_lora = layer(hidden, delta, delta_lora, rotary, ctx, lora)
        return hidden, delta, delta_lora, lora


def plan_module_matmuls(root: nn.Module, max_rows: int, tiles: MatmulTiles) -> dict:
    """The matmul plans (matmul_plan.py) of every base projection and LM head under root (a
    model, or one of its blocks in a test), handed to each layer. -> the plans by key."""
    from lorad.workers.matmul_plan import plan_model_matmuls
    layers = []
    for module in root.modules():
        if isinstance(module, (FusedColumnParallelLinear, ParallelLMHead)):
            layers.append((module, module.weight, None))
        elif isinstance(module, RowParallelLinear):
            layers.append((module, module.weight, module.matmul_out_dtype()))
    return plan_model_matmuls(layers, max_rows, tiles)
