"""Random PEFT LoRA adapters for the tiny checkpoints, made by `peft` itself (no downloads).

Both factors are random (PEFT's default zero B would make every adapter a no-op), scaled so an
adapter visibly moves the logits. Same arguments, same files.
"""

from __future__ import annotations

from pathlib import Path

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(base_dir, out_dir, *, r: int = 4, lora_alpha: float = 8,
                      target_modules=ALL_MODULES, seed: int = 0, rank_pattern=None,
                      alpha_pattern=None, use_rslora: bool = False, layers_to_transform=None,
                      magnitude: float = 0.2) -> Path:
    """Save a LoRA adapter for the model in base_dir as PEFT does; returns out_dir."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0,
        bias="none", rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
        use_rslora=use_rslora, layers_to_transform=layers_to_transform, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * magnitude)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out


def cast_adapter(src_dir, out_dir, dtype) -> Path:
    """A copy of the PEFT folder src_dir with its factors stored as `dtype` (a torch dtype, e.g.
    torch.bfloat16: rounded once, as an adapter trained or saved in that dtype holds them)."""
    import shutil

    from safetensors.torch import load_file, save_file
    src, out = Path(src_dir), Path(out_dir)
    shutil.copytree(src, out)
    weights = out / "adapter_model.safetensors"
    save_file({name: t.to(dtype) for name, t in load_file(str(weights)).items()}, str(weights),
              metadata={"format": "pt"})
    return out
