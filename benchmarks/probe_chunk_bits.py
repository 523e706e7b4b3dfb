"""Where a prompt token's bits start to depend on its chunking (issue 29): the tiny bf16 Llama of
tests/gpu/test_invariance_gpu.py (matmul plans measured), one prompt prefilled whole and then in
chunks of --chunk tokens, under the base model (slot 0) or the adapter (slot 1). The
intermediates of every layer (the input norm's output, the fused q/k/v product, attention, the
attention block's output after o_proj, the post-attention norm's output, gate/up, the MLP's
output after down_proj, the layer's output) are recorded per position in both runs, through
forward hooks; prints, for each one that differs, the positions that differ and the largest
difference, in the order the model runs them.

    python -m benchmarks.probe_chunk_bits [--chunk 7] [--slot 0] [--device cuda]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from lorad.workers.batch import ForwardBatch
from tests.model_steps import Stream, build_model
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama

BLOCK_SIZE = 4
PROMPT_LEN = 230


class Recorder:
    """Forward hooks on the model's modules; each call's tensors are kept under their names, in
    the order of the step."""

    def __init__(self) -> None:
        self.step: list[tuple[str, torch.Tensor]] = []

    def keep(self, name: str, values) -> None:
        for i, t in enumerate(flatten(values)):
            self.step.append((f"{name}.{i}", t.detach().clone()))

    def outputs(self, module: torch.nn.Module, name: str) -> None:
        module.register_forward_hook(lambda _m, _args, out: self.keep(name, out))

    def inputs(self, module: torch.nn.Module, name: str) -> None:
        module.register_forward_pre_hook(lambda _m, args: self.keep(name, args[0]))


def flatten(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in flatten(item)]
    return []


def instrument(model, recorder: Recorder) -> None:
    for index, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        recorder.inputs(attn.qkv_proj, f"L{index}.input_norm")
        recorder.outputs(attn.qkv_proj, f"L{index}.qkv")
        recorder.outputs(attn.attn, f"L{index}.attn")
        recorder.outputs(attn, f"L{index}.o_proj")
        recorder.inputs(mlp.gate_up_proj, f"L{index}.post_norm")
        recorder.outputs(mlp.gate_up_proj, f"L{index}.gate_up")
        recorder.outputs(mlp, f"L{index}.down")
        recorder.outputs(layer, f"L{index}.out")


def run(model, recorder: Recorder, prompt: list[int], slot: int, index: int, sizes: list,
        device: torch.device, per_stream: int) -> dict[str, torch.Tensor]:
    """Prefill `prompt` in chunks of `sizes`; -> each recorded name's rows by position."""
    blocks = list(range(1 + index * per_stream, 1 + (index + 1) * per_stream))
    stream = Stream(list(prompt), slot, blocks, BLOCK_SIZE, prompt_len=len(prompt))
    by_position: dict[str, list[torch.Tensor]] = defaultdict(list)
    for size in sizes:
        start = stream.num_cached
        chunk = stream.prefill_chunk(size)
        num_real = stream.num_cached - start
        recorder.step = []
        model.forward(ForwardBatch.build([chunk], BLOCK_SIZE, device))
        for name, tensor in recorder.step:
            if tensor.dim() >= 1 and tensor.shape[0] >= num_real:
                by_position[name].append(tensor[:num_real])
    return {name: torch.cat(parts) for name, parts in by_position.items()
            if sum(p.shape[0] for p in parts) == len(prompt)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=7)
    parser.add_argument("--slot", type=int, default=0, help="0: the base model, 1: the adapter")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-rows", type=int, default=256, help="matmul plans up to this")
    args = parser.parse_args()
    device = torch.device(args.device)
    per_stream = -(-(PROMPT_LEN + 16) // BLOCK_SIZE)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = make_tiny_llama(root / "llama", with_tokenizer=False, hidden_size=96,
                                     num_attention_heads=6, num_key_value_heads=3,
                                     intermediate_size=100, vocab_size=401, seed=5)
        adapter = make_peft_adapter(checkpoint, root / "a1", r=4, seed=31, magnitude=0.1)
        model = build_model(checkpoint, [adapter], torch.bfloat16, device, 4 * per_stream + 2,
                            BLOCK_SIZE)
    if device.type == "cuda":
        model.plan_matmuls(args.max_rows)
    recorder = Recorder()
    instrument(model, recorder)
    rng = random.Random(9 + args.slot)
    prompt = [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]
    sizes = [args.chunk] * (PROMPT_LEN // args.chunk)
    if PROMPT_LEN % args.chunk:
        sizes.append(PROMPT_LEN % args.chunk)
    with torch.inference_mode():
        whole = run(model, recorder, prompt, args.slot, 0, [None], device, per_stream)
        chunked = run(model, recorder, prompt, args.slot, 1, sizes, device, per_stream)
    print(f"slot {args.slot}, chunks of {args.chunk}: {len(whole)} intermediates compared")
    differing = 0
    for name, want in whole.items():
        got = chunked.get(name)
        if got is None or got.shape != want.shape:
            print(f"{name}: not comparable")
            continue
        rows = (got != want).flatten(1).any(1).nonzero().flatten().tolist()
        if rows:
            differing += 1
            diff = (got.float() - want.float()).abs().max().item()
            print(f"{name}: {len(rows)} positions differ, first {rows[:12]}, max |diff| {diff:.3g}")
    print(f"{differing} of {len(whole)} intermediates differ")


if __name__ == "__main__":
    main()
