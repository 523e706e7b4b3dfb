"""The logits transforms a request may ask for, on the leader, after the grammar mask and before
the sampler's warpers: logit_bias and the min_tokens mask, then the repetition, frequency and
presence penalties, as vLLM defines them (docs/api.md, *Sampling order*).

Only the rows whose request set one are touched (their logits are gathered, transformed and
written back); the others keep their bits and cost one attribute check each. Everything is
elementwise or a scatter of exact values (counts of ones, a bias added once), so a row's result
depends on that row alone and is the same on the CPU and on a GPU. The token histories travel
to the logits' device in one copy per step; nothing is read back. min_p is the sampler's (it
follows top-p). Log probabilities are taken before this runs (logprobs.py).
"""

from __future__ import annotations

import torch

from lorad.protocol.messages import SamplingParams


def rows_to_transform(params: list[SamplingParams]) -> list[int]:
    """The positions of a step's rows whose request transforms its logits (usually none)."""
    return [i for i, p in enumerate(params) if p.transforms_logits]


def transform(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
              prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Apply each row's transforms to logits ([num_sampled, vocab] fp32), in place.

    rows: positions in logits (ascending, as rows_to_transform gives them); params, prompts and
    outputs: those rows' sampling parameters, prompt ids and generated ids, in the same order.
    """
    if not rows:
        return
    packed = _Packed(rows, params, prompts, outputs)
    values = torch.tensor(packed.floats, dtype=torch.float32).to(logits.device)  # one copy
    with torch.inference_mode():  # the engine's logits are inference tensors
        index = packed.part(values, "rows").long()
        transformed = apply_rows(logits[index], packed, values)
        logits[index] = transformed


class _Packed:
    """A step's transform inputs as one flat fp32 list (token ids and row numbers below 2**24
    are exact), with each part's (start, stop) in it; pairs are (row in the gathered batch,
    token id) in two parts of equal length."""

    def __init__(self, rows: list[int], params: list[SamplingParams],
                 prompts: list[list[int]], outputs: list[list[int]]) -> None:
        parts: dict[str, list] = {name: [] for name in (
            "rows", "repetition", "frequency", "presence", "bias_rows", "bias_ids",
            "bias_values", "mask_rows", "mask_ids", "seen_rows", "seen_ids", "count_rows",
            "count_ids")}
        for j, (row, p, prompt, output) in enumerate(zip(rows, params, prompts, outputs)):
            parts["rows"].append(row)
            parts["repetition"].append(p.repetition_penalty)
            parts["frequency"].append(p.frequency_penalty)
            parts["presence"].append(p.presence_penalty)
            for entry in p.logit_bias:
                parts["bias_rows"].append(j)
                parts["bias_ids"].append(entry.token_id)
                parts["bias_values"].append(entry.bias)
            if len(output) < p.min_tokens:
                ending = p.request_stop_token_ids + ([] if p.ignore_eos else p.stop_token_ids)
                parts["mask_rows"].extend([j] * len(ending))
                parts["mask_ids"].extend(ending)
            if p.repetition_penalty != 1.0:  # CTRL's: every token seen, prompt and output
                parts["seen_rows"].extend([j] * (len(prompt) + len(output)))
                parts["seen_ids"].extend(prompt)
                parts["seen_ids"].extend(output)
            if p.frequency_penalty or p.presence_penalty:  # OpenAI's: the output only
                parts["count_rows"].extend([j] * len(output))
                parts["count_ids"].extend(output)
        self.floats: list[float] = []
        self.spans: dict[str, tuple[int, int]] = {}
        for name, part in parts.items():
            self.spans[name] = (len(self.floats), len(self.floats) + len(part))
            self.floats.extend(part)
        self.any_repetition = bool(parts["seen_rows"])
        self.any_counts = bool(parts["count_rows"])

    def size(self, name: str) -> int:
        start, stop = self.spans[name]
        return stop - start

    def part(self, values: torch.Tensor, name: str) -> torch.Tensor:
        start, stop = self.spans[name]
        return values[start:stop]


def apply_rows(batch: torch.Tensor, packed: _Packed, values: torch.Tensor) -> torch.Tensor:
    """batch [n, vocab] fp32, the gathered rows (a copy) -> the transformed rows."""
    def pairs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (packed.part(values, f"{name}_rows").long(),
                packed.part(values, f"{name}_ids").long())

    if packed.size("bias_rows"):  # ids are unique per row: each bias is added exactly once
        rows, ids = pairs("bias")
        batch[rows, ids] += packed.part(values, "bias_values")
    if packed.size("mask_rows"):
        batch[pairs("mask")] = float("-inf")
    if packed.any_repetition:
        seen = torch.zeros_like(batch, dtype=torch.bool)  # [n, vocab]
        seen[pairs("seen")] = True
        penalty = packed.part(values, "repetition")[:, None]  # [n, 1]; 1 for rows without
        penalized = torch.where(batch > 0, batch / penalty, batch * penalty)
        batch = torch.where(seen, penalized, batch)
    if packed.any_counts:
        counts = torch.zeros_like(batch)  # [n, vocab] fp32: sums of ones are exact
        rows, ids = pairs("count")
        counts.index_put_((rows, ids), torch.ones_like(rows, dtype=batch.dtype), accumulate=True)
        batch = batch - packed.part(values, "frequency")[:, None] * counts
        batch = batch - packed.part(values, "presence")[:, None] * (counts > 0).to(batch.dtype)
    return batch
