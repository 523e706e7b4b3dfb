"""The Qwen2-MoE family (Qwen2MoeForCausalLM): the Llama family's layers with q/k/v biases, and
in each sparse layer the MoE block (moe.py) in place of the dense MLP; composes, owns no collective.

Dense layers (mlp_only_layers, or off decoder_sparse_step) keep the dense MLP. Checkpoint names
are the Hugging Face ones: routed experts one tensor per expert and projection
(`mlp.experts.<e>.gate_proj.weight`), loaded into per-layer stacks. Adapters may edit the
attention projections, the shared expert's and the dense layers' MLP projections.
"""

from __future__ import annotations

import torch
from torch import nn

from lorad.workers.fused_linear import FusedPart
from lorad.workers.linear import RowParallelLinear
from lorad.workers.models.llama import LlamaForCausalLM
from lorad.workers.moe import ReplicatedLinear, RoutedExperts, SparseMoeBlock

SHARED_EXPERT = "shared_expert."  # prefix of the shared expert's projections in adapter modules


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def layer_mlp(self, layer: int) -> nn.Module | None:
        """The MoE block in sparse layers; None (the dense MLP) in the others."""
        if not self.config.is_moe_layer(layer):
            return None
        return SparseMoeBlock(self.config, self.tp, self.dtype, self.device, self.tuning)

    def _experts(self) -> list[tuple[str, RoutedExperts]]:
        return [(name, m) for name, m in self.named_modules() if isinstance(m, RoutedExperts)]

    def weight_targets(self) -> dict[str, tuple[nn.Parameter, object]]:
        """The dense family's targets, with each layer's expert stacks as one checkpoint tensor
        per expert and projection (shard id (projection, expert))."""
        targets = super().weight_targets()
        for name, experts in self._experts():
            del targets[f"{name}.gate_up"], targets[f"{name}.down"]
            targets.update({key: (param, shard_id) for key, (param, shard_id, _)
                            in experts.checkpoint_parts(name).items()})
        return targets

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().checkpoint_shapes()
        for name, module in self.named_modules():
            if isinstance(module, ReplicatedLinear):
                shapes[f"{name}.weight"] = tuple(module.weight.shape)
            elif isinstance(module, RoutedExperts):
                shapes.update({key: shape for key, (_, _, shape)
                               in module.checkpoint_parts(name).items()})
        return shapes

    def shard_view(self, name: str, shard_id) -> torch.Tensor:
        if isinstance(shard_id, tuple):  # (projection, expert) of a layer's expert stacks
            experts = self.get_submodule(name.rsplit(".", 3)[0])
            return experts.shard_view(shard_id)
        return super().shard_view(name, shard_id)

    def lora_target(self, layer: int, module: str) -> FusedPart | RowParallelLinear:
        """What an adapter module edits: the dense family's projections, or the shared expert's
        (`shared_expert.gate_proj` ...) in a sparse layer."""
        if not module.startswith(SHARED_EXPERT):
            return super().lora_target(layer, module)
        shared = self.model.layers[layer].mlp.shared_expert
        projection = module.removeprefix(SHARED_EXPERT)
        if projection == "down_proj":
            return shared.down_proj
        return shared.gate_up_proj.part(projection.removesuffix("_proj"))
