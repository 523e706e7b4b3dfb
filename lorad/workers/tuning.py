"""The engine's tuning: one frozen value holding every kernel's launch settings.

The engine builds one (Tuning(): the product's choices) and passes it down: the model hands each
layer its part, and each step carries its PDL row limit. Some fields (the LoRA row tiles,
attention's split and tile) fix a row's bits, so a server keeps one Tuning for its life.
Benchmarks build variants with dataclasses.replace, or from text with `replaced`. No triton
import: the CPU path builds one too, and never launches a kernel.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from dataclasses import dataclass

from lorad.workers.kernels.configs import (DecodeAttentionConfig, ExpandSteps, GemvModelTiles,
                                           MatmulTiles, MoeConfig, OneshotConfig, PdlConfig,
                                           ShrinkConfig, TileConfig)


@dataclass(frozen=True)
class Tuning:
    pdl: PdlConfig = PdlConfig()  # the decode kernels' programmatic dependent launch
    tiles: TileConfig = TileConfig()  # the LoRA kernels' row tiles and grids
    shrink: ShrinkConfig = ShrinkConfig()
    expand: ExpandSteps = ExpandSteps()
    matmul: MatmulTiles = MatmulTiles()  # row_matmul's tiles, where cuBLAS splits K
    gemv: GemvModelTiles = GemvModelTiles()  # the base projections' decode GEMV
    attention: DecodeAttentionConfig = DecodeAttentionConfig()  # decode attention
    moe: MoeConfig = MoeConfig()  # the fused MoE kernel's tiles (Qwen2-MoE's routed experts)
    oneshot: OneshotConfig = OneshotConfig()  # the one-shot all-reduce (--all-reduce)


def replaced(tuning: Tuning, settings: str) -> Tuning:
    """`tuning` with settings applied by nested dataclasses.replace: settings are
    PATH=VALUE joined by '+', PATH a dotted field path (shrink.items_per_sm,
    expand.small.block_n, gemv.o), VALUE a Python literal (None, numbers, True/False, strings);
    a path into a field that holds None starts from its type's defaults (gemv.o.block_m=16: the
    decode GEMV for o, GemvConfig() with block_m 16). 'main' (or '') changes nothing. Raises
    ValueError naming a part it cannot apply."""
    if settings in ("", "main"):
        return tuning
    for part in settings.split("+"):
        path, sep, text = part.partition("=")
        try:
            if not sep or not path:
                raise ValueError("not PATH=VALUE")
            tuning = _replace_path(tuning, path.strip().split("."), ast.literal_eval(text.strip()))
        except (ValueError, SyntaxError, TypeError) as exc:
            raise ValueError(f"cannot apply tuning setting {part!r}: {exc}") from None
    return tuning


def _replace_path(obj, path: list[str], value):
    """obj with the field at `path` (a list of names) set to value, each level replaced."""
    if not dataclasses.is_dataclass(obj):
        raise ValueError(f"{type(obj).__name__} has no fields")
    names = {f.name for f in dataclasses.fields(obj)}
    if path[0] not in names:
        raise ValueError(f"{type(obj).__name__} has no field {path[0]!r} "
                         f"(fields: {', '.join(sorted(names))})")
    if len(path) > 1:
        inner = getattr(obj, path[0])
        if inner is None:  # an optional setting: its type's defaults, then the path's change
            inner = _optional_type(type(obj), path[0])()
        value = _replace_path(inner, path[1:], value)
    return dataclasses.replace(obj, **{path[0]: value})


def _optional_type(cls: type, name: str) -> type:
    """The dataclass of field `name` of cls, declared `SomeConfig | None`."""
    hint = typing.get_type_hints(cls)[name]
    kinds = [arg for arg in typing.get_args(hint) if dataclasses.is_dataclass(arg)]
    if len(kinds) != 1:
        raise ValueError(f"{cls.__name__}.{name} is None and has no settings")
    return kinds[0]
