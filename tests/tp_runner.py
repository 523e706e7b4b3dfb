"""One rank of a tensor-parallel test run: load models, run scripted batches, write the logits.

    python tests/tp_runner.py --rank R --world N --init-file PATH --spec SPEC.json --out DIR
                              [--backend gloo|nccl] [--device cpu|cuda]

SPEC.json: {"models": [{"name", "dir", "dtype", "num_blocks", "block_size",
"scenarios": {name: [step, ...]}[, "adapters": [{"name", "path", "strength"}, ...]]
[, "graphs": {"max_num_seqs", "max_model_len"}]}]}, a step
being a list of chunks [token_ids, start_position, block_table, wants_sample, adapter_slot
[, adapter_strength]]
(ForwardBatch.build's). Adapters take slots 1..K in list order, through lorad's load_adapter.
Each rank writes DIR/<model>.rank<R>.safetensors with one tensor "<scenario>.<step>" per step:
that step's [num_sampled, vocab_size] float32 logits. With "graphs" (CUDA), decode steps replay
the decode CUDA graphs (in segments over gloo) and "<scenario>.<step>.eager" holds the same
padded step run eagerly. Tensors travel as safetensors, never pickle.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lorad.config import ModelConfig  # noqa: E402
from lorad.config.adapters import AdapterArg, load_adapter  # noqa: E402
from lorad.workers.batch import ForwardBatch  # noqa: E402
from lorad.workers.cuda_graph import DecodeGraphs  # noqa: E402
from lorad.workers.models import MODEL_CLASSES  # noqa: E402
from lorad.workers.parallel import init_tensor_parallel  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_model(entry: dict, tp, out_dir: Path) -> None:
    config = ModelConfig.from_dir(entry["dir"])
    model = MODEL_CLASSES[config.model_type](config, tp, DTYPES[entry["dtype"]], tp.device)
    model.load_weights(entry["dir"])
    args = [AdapterArg(a["name"], a["path"], a["strength"]) for a in entry.get("adapters", [])]
    model.load_adapters(tuple(load_adapter(arg, slot, config)
                              for slot, arg in enumerate(args, start=1)))
    model.allocate_kv_cache(entry["num_blocks"], entry["block_size"])
    graphs = padded = None
    if "graphs" in entry:  # {"max_num_seqs", "max_model_len"}: decode steps replay CUDA graphs
        opts = (entry["graphs"]["max_num_seqs"], entry["graphs"]["max_model_len"],
                entry["block_size"], len(args))
        segmented = tp.world_size > 1 and tp.backend == "gloo"
        graphs = DecodeGraphs(model, *opts, segmented=segmented)
        graphs.capture()
        padded = DecodeGraphs(model, *opts)  # never captured: the same padded step, eagerly
    outputs = {}
    for scenario, steps in entry["scenarios"].items():
        for i, chunks in enumerate(steps):
            chunks = [tuple(c) for c in chunks]
            if graphs is not None and graphs.can_run(chunks):
                # The eager run first: the replay then rewrites the same KV with its own.
                outputs[f"{scenario}.{i}.eager"] = padded.run(chunks).cpu().contiguous()
                outputs[f"{scenario}.{i}"] = graphs.run(chunks).cpu().contiguous()
                continue
            batch = ForwardBatch.build(chunks, entry["block_size"], tp.device)
            outputs[f"{scenario}.{i}"] = model(batch).cpu().contiguous()
    save_file(outputs, str(out_dir / f"{entry['name']}.rank{tp.rank}.safetensors"))


def launch_ranks(models_by_world: dict[int, list[dict]], root: Path, backend: str = "gloo",
                 device: str = "cpu", timeout_s: float = 180) -> dict[int, Path]:
    """Run every world size at once, each rank a process of this script; -> world size -> the
    folder of its ranks' output files. Fails with the output of every rank that failed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs, outs = [], {}
    for world, models in models_by_world.items():
        out = root / f"world{world}"
        out.mkdir()
        spec = root / f"spec{world}.json"
        spec.write_text(json.dumps({"models": models}))
        for rank in range(world):
            cmd = [sys.executable, __file__, "--rank", str(rank), "--world", str(world),
                   "--init-file", str(root / f"store{world}"), "--spec", str(spec),
                   "--out", str(out), "--backend", backend, "--device", device]
            procs.append((world, rank, subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        outs[world] = out
    failures = []
    for world, rank, proc in procs:
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        if proc.returncode != 0:
            failures.append(f"world {world} rank {rank} exited {proc.returncode}:\n{output}")
    assert not failures, "\n".join(failures)
    return outs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init-file", required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    # One thread: with more, MKL may split a matmul differently by batch size, and the
    # batch-invariance checks compare bits (shared/DESIGN.md, "Numerics").
    torch.set_num_threads(1)
    start = time.monotonic()
    spec = json.loads(Path(args.spec).read_text())
    # Ranks share GPUs round-robin, as the workers do: gloo runs several ranks on one card.
    device = (torch.device("cuda", args.rank % torch.cuda.device_count())
              if args.device == "cuda" else torch.device("cpu"))
    tp = init_tensor_parallel(args.rank, args.world, f"file://{args.init_file}", args.backend,
                              device, timeout_s=120)
    for entry in spec["models"]:
        run_model(entry, tp, Path(args.out))
    if args.world > 1:
        torch.distributed.destroy_process_group()
    print(f"rank {args.rank}/{args.world}: {time.monotonic() - start:.2f}s", flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown, as the workers do (lorad/workers/__main__.py): destroying gloo's
    # threads there sometimes aborted a rank that had written everything ("terminate called
    # without an active exception", exit -6), seen under load.
    os._exit(0)
