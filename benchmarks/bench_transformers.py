#!/usr/bin/env python3
"""The reference figure for scripts/bench.py: transformers' `generate` on the same model, fp32, CPU.

One batch of --batch random prompts of --prompt-len tokens (the same kind bench.py sends), greedy,
exactly --max-tokens new tokens each (EOS suppressed, like ignore_eos). Prints tokens/s with the
conditions. Prefill is inside the timed region, as it is for the server.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

from benchmarks.common import device_name

PROMPT_ID_RANGE = (100, 1000)  # as bench.py draws its random prompts


def default_model_dir() -> Path:
    explicit = os.environ.get("LORAD_DEMO_MODEL_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "lorad" / "SmolLM2-135M-Instruct"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_dir(),
                        help="Hugging Face model folder (default: the converted demo model)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                        help="load a PEFT adapter (repeatable); rows then rotate over the base "
                             "and every adapter with peft's mixed-batch adapter_names, as "
                             "bench.py --model BASE,NAME,... does against lorad")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"bench_transformers: {args.model} is not a model folder; run scripts/serve-demo "
              "once or scripts/prepare_demo_model.py DIR, or pass --model", file=sys.stderr)
        return 2

    import torch
    import transformers

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    generate_kwargs = {}
    if args.adapter:
        from peft import PeftModel

        adapters = [spec.split("=", 1) for spec in args.adapter]
        model = PeftModel.from_pretrained(model, adapters[0][1], adapter_name=adapters[0][0])
        for name, folder in adapters[1:]:
            model.load_adapter(folder, adapter_name=name)
        model.eval()
        rotation = ["__base__"] + [name for name, _ in adapters]
        generate_kwargs["adapter_names"] = [rotation[i % len(rotation)] for i in range(args.batch)]
    rng = random.Random(args.seed)
    input_ids = torch.tensor([[rng.randrange(*PROMPT_ID_RANGE) for _ in range(args.prompt_len)]
                              for _ in range(args.batch)])  # [batch, prompt_len]
    attention_mask = torch.ones_like(input_ids)
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = model.generation_config.eos_token_id
    if isinstance(pad_id, list):
        pad_id = pad_id[0]

    def generate(num_tokens: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                  max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                  do_sample=False, pad_token_id=pad_id, **generate_kwargs)

    generate(4)  # warm-up: first-call allocations and kernel selection
    started = time.perf_counter()
    out = generate(args.max_tokens)
    wall_s = time.perf_counter() - started
    num_new = (out.shape[1] - args.prompt_len) * args.batch

    print(f"date:      {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"machine:   {os.cpu_count()} cores, {device_name('cpu')}, {platform.system()} "
          f"{platform.machine()}; torch {torch.__version__} with {torch.get_num_threads()} "
          f"threads, transformers {transformers.__version__}")
    print(f"model:     {args.model} (float32, cpu)"
          + (f", rows rotating over base + {', '.join(a.split('=')[0] for a in args.adapter)} "
             "(peft adapter_names)" if args.adapter else ""))
    print(f"workload:  one batch of {args.batch} random {args.prompt_len}-token prompts, "
          f"{args.max_tokens} new tokens each, greedy, EOS suppressed")
    print()
    print("| metric | value |")
    print("|---|---|")
    print(f"| output tokens/s | {num_new / wall_s:.1f} |")
    print(f"| wall time (s) | {wall_s:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
