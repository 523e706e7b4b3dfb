"""Random PEFT LoRA adapters for the tiny checkpoints, made by `peft` itself (no downloads), and
clones of one with other random factors (clone_adapter) where a test needs hundreds.

Both factors are random (PEFT's default zero B would make every adapter a no-op), scaled so an
adapter visibly moves the logits. Same arguments, same files.
"""

from __future__ import annotations

from pathlib import Path

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS_FILE = "adapter_model.safetensors"


def make_peft_adapter(base_dir, out_dir, *, r: int = 4, lora_alpha: float = 8,
                      target_modules=ALL_MODULES, seed: int = 0, rank_pattern=None,
                      alpha_pattern=None, use_rslora: bool = False, layers_to_transform=None,
                      magnitude: float = 0.2) -> Path:
    """Save a LoRA adapter for the model in base_dir as PEFT does; returns out_dir."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM  # a Llama or a Qwen2-MoE

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, lora_dropout=0.0,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
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


def peft_logits(model, folders: dict, slots: dict, seqs: dict) -> dict:
    """(slot, sequence) -> fp32 logits [seq_len, vocab] of each full sequence: slot 0 by
    `model` itself, slot s by peft over it with folders[slots[s][1]] at strength slots[s][2]
    (what lorad's strength does: the scale multiplied)."""
    import torch

    refs = {}
    with torch.no_grad():
        for seq, ids in seqs.items():
            refs[(0, seq)] = model(torch.tensor([ids])).logits[0]
        for slot, (_, folder, strength) in slots.items():
            peft_model = scaled_peft_model(model, folders[folder], f"slot{slot}", strength)
            for seq, ids in seqs.items():
                refs[(slot, seq)] = peft_model(torch.tensor([ids])).logits[0]
            model = peft_model.unload()  # the base model again, without LoRA layers
    return refs


def scaled_peft_model(model, folder, name: str, factor: float):
    """`model` (transformers) wrapped by peft with the adapter in `folder` as `name`, every LoRA
    layer's scaling multiplied by `factor` (what lorad's registered and per-request strengths
    do); unload() gives the base model back. `name`: not an adapter's served name, since peft's
    adapter names become attributes."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(model, folder, adapter_name=name)
    for module in peft_model.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and name in scaling:
            scaling[name] *= factor
    return peft_model


def make_checkpoint(root: Path, model: dict, folders: dict[str, dict]) -> tuple[Path, dict]:
    """A tiny Llama (make_tiny_llama's keywords `model`, no tokenizer) in root/base and one peft
    folder per entry of `folders` (make_peft_adapter's keywords) -> (base, {name: folder})."""
    from tests.tiny_models import make_tiny_llama

    base = make_tiny_llama(root / "base", with_tokenizer=False, **model)
    return base, {name: make_peft_adapter(base, root / name, **kwargs)
                  for name, kwargs in folders.items()}


def reference_llama(base: Path):
    """transformers' fp32 model of `base`, eager attention, in eval mode: the logits tests'
    reference."""
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(base, dtype=torch.float32,
                                            attn_implementation="eager").eval()


def clone_adapter(template, out_dir, seed: int, magnitude: float = 0.2) -> Path:
    """A PEFT folder with the template's adapter_config.json and tensor names and shapes, and
    other random factors (seed): many distinct adapters at the cost of one file write each."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    out.mkdir(parents=True)
    shutil.copy(Path(template) / "adapter_config.json", out / "adapter_config.json")
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(t.shape, generator=generator) * magnitude
               for name, t in sorted(load_file(Path(template) / WEIGHTS_FILE).items())}
    save_file(tensors, out / WEIGHTS_FILE)
    return out
