"""`lorad check-adapter DIR... [--model DIR] [--parallel N]`: the serve-time checks, offline.

Prints, per folder, what the adapter edits (layers x projections, ranks, scales), its identity key
and the factor memory each rank would hold; exit 1 if any adapter is refused, 2 on bad flags.
Without --model it checks everything that needs no base and says what it could not check.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import groupby
from pathlib import Path

from lorad.config.adapter_memory import bytes_per_rank, total_bytes
from lorad.config.adapters import MODULE_ORDER, AdapterSpec, read_adapter
from lorad.config.cli import OneLineParser, positive_int
from lorad.config.errors import ConfigError
from lorad.config.partition import check_parallel
from lorad.config.model import ModelConfig


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="lorad check-adapter",
                     description="Validate PEFT LoRA folders as `lorad --adapter` would, without "
                                 "loading any weights of the base model.")
    parser.add_argument("folders", nargs="+", metavar="DIR", help="adapter folder(s)")
    parser.add_argument("--model", metavar="DIR",
                        help="the base model folder (its config.json): check shapes and layer "
                             "indices against it and compute per-rank memory")
    parser.add_argument("--parallel", type=positive_int, default=1, metavar="N",
                        help="tensor-parallel ranks to compute per-rank memory for "
                             "(default: %(default)s)")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model = None
    try:
        if args.model is not None:
            model = ModelConfig.from_dir(args.model)
            check_parallel(model, args.parallel)
    except ConfigError as exc:
        parser.error(str(exc))
    refused = 0
    for slot, folder in enumerate(args.folders, start=1):
        try:
            spec = read_adapter(Path(folder), Path(folder).name, 1.0, slot, model)
        except ConfigError as exc:
            print(f"{folder}: refused: {exc}")
            refused += 1
            continue
        print("\n".join(describe(spec, folder, model, args.model, args.parallel)))
    return 1 if refused else 0


def describe(spec: AdapterSpec, folder: str, model: ModelConfig | None, model_dir: str | None,
             parallel: int) -> list[str]:
    layers = sorted({m.layer for m in spec.modules})
    kinds = [k for k in MODULE_ORDER if any(m.module == k for m in spec.modules)]
    dtypes = sorted({m.dtype for m in spec.modules})
    lines = [f"{folder}: ok", f"  key       {spec.key}"]
    if model is not None:
        lines.append(f"  base      shapes and layers checked against {model_dir} "
                     f"({model.num_hidden_layers} layers)")
    else:
        lines.append("  base      NOT CHECKED (no --model): shapes, layer indices and per-rank "
                     "memory need the base config")
    lines.append(f"  manifest  {_manifest_line(spec)}")
    lines.append(f"  edits     {len(spec.modules)} projections: layers {_ranges(layers)} "
                 f"({len(layers)}) x {', '.join(kinds)}; factors {', '.join(dtypes)}")
    width = _module_width(spec)
    lines.append(f"    {'module':<{width}} {'layers':<12} {'rank':>4} {'scale':>10}  "
                 f"{'A [r, in]':<14} B [out, r]")
    for row in _module_rows(spec):
        lines.append("    " + row)
    memory = f"whole adapter {_size(total_bytes(spec))}"
    if model is not None:
        per_rank = bytes_per_rank(spec, model, parallel)
        memory += f"; per rank at --parallel {parallel}: " + ", ".join(
            f"rank {r} {_size(b)}" for r, b in enumerate(per_rank))
    lines.append(f"  memory    {memory} (factors as stored, unpadded)")
    return lines


def _manifest_line(spec: AdapterSpec) -> str:
    base = f"base model {spec.base_model!r}" if spec.base_model else "base model not named"
    if not spec.has_manifest:
        return f"none (no lorad-adapter.json); {base} (adapter_config.json)"
    return f"lorad-adapter.json agrees with the files; {base}"


def _module_width(spec: AdapterSpec) -> int:
    """The module column's width: 10, or a Qwen2-MoE shared expert's longer names."""
    return max(10, *(len(m.module) for m in spec.modules))


def _module_rows(spec: AdapterSpec) -> list[str]:
    def group_key(m):
        return (MODULE_ORDER.index(m.module), m.rank, m.scale, m.in_features,
                m.out_features)

    rows = []
    for (_, rank, scale, in_f, out_f), group in groupby(
            sorted(spec.modules, key=lambda m: (group_key(m), m.layer)), key=group_key):
        group = list(group)
        layers = _ranges([m.layer for m in group])
        rows.append(f"{group[0].module:<{_module_width(spec)}} {layers:<12} {rank:>4} {scale:>10.6g}  "
                    f"{json.dumps([rank, in_f]):<14} {json.dumps([out_f, rank])}")
    return rows


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    parts, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(parts)


def _size(num_bytes: int) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= factor:
            return f"{num_bytes / factor:.1f} {unit}"
    return f"{num_bytes} B"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
