"""The logits transforms a request may ask for, on the leader, after the grammar mask and before
the sampler's warpers: logit_bias and the min_tokens mask, then the repetition, frequency and
presence penalties, as vLLM defines them (docs/api.md, *Sampling order*).

Only the (row, token) entries a transform changes are read and written, in place: rows that ask
for nothing keep their bits and cost one attribute check each, and no [rows, vocab] temporary is
made. Every write is elementwise from one entry's own value (a bias added once, a count of the
sequence's own tokens), so a row's result depends on that row alone and is the same on the CPU
and on a GPU. The leader keeps, per request, its output token counts (brought up to date from
the sequence's ids each step) and its prompt's distinct ids on the logits' device; a step's
entries travel in one copy and nothing is read back. min_p is the sampler's (it follows top-p).
Log probabilities are taken before this runs (logprobs.py).
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field

import torch

from lorad.protocol.messages import SamplingParams
from lorad.workers.sequence import Sequence


def rows_to_transform(params: list[SamplingParams]) -> list[int]:
    """The positions of a step's rows whose request transforms its logits (usually none)."""
    return [i for i, p in enumerate(params) if p.transforms_logits]


@dataclass
class _History:
    """One request's tokens as its transforms need them."""

    counts: Counter = field(default_factory=Counter)  # output token id -> times generated
    num_counted: int = 0  # output tokens counted so far
    prompt_ids: torch.Tensor | None = None  # [distinct prompt ids] int64 on the logits' device


class _Segments:
    """A step's entries as one flat fp32 list (ids, counts and row numbers below 2**24 are
    exact): a header of `width` values per row (its row first, its number of entries second),
    and the rows' entries, each a flat list, concatenated in row order."""

    def __init__(self, width: int, *entries: str) -> None:
        self.width = width
        self.header: list[float] = []
        self.entries: dict[str, list] = {name: [] for name in entries}

    def pack(self, floats: list) -> tuple[int, list[int]]:
        """Append to floats -> (where the header starts, where each entry list starts)."""
        start = len(floats)
        floats += self.header
        starts = []
        for values in self.entries.values():
            starts.append(len(floats))
            floats += values
        return start, starts


class LogitsTransforms:
    def __init__(self) -> None:
        self._histories: dict[str, _History] = {}

    def remove(self, request_id: str) -> None:
        self._histories.pop(request_id, None)

    def apply(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
        """Transform logits ([num_sampled, vocab] fp32) in place: row rows[j] is seqs[j]'s
        (rows as rows_to_transform gives them)."""
        if not rows:
            return
        segments, prompts = self._collect(rows, seqs, logits.device)
        floats: list = []
        layout = [part.pack(floats) for part in segments]
        if not floats:  # e.g. only min_tokens, and that many were generated
            return
        # One copy to the device; an array's fp32 buffer is made several times faster than a
        # tensor from the list.
        values = torch.frombuffer(array("f", floats), dtype=torch.float32).to(logits.device)
        parts = []
        for part, (start, starts) in zip(segments, layout):
            header = values[start:start + len(part.header)].reshape(-1, part.width)
            total = (sum(len(ids) for ids in prompts) if not part.entries
                     else len(next(iter(part.entries.values()))))
            # The header's row per entry (and its other columns); the size is known on the
            # host, so repeat_interleave needs no sync.
            per_entry = torch.repeat_interleave(header, header[:, 1].long(), dim=0,
                                                output_size=total)  # [total, width]
            parts.append((per_entry, [values[s:s + total] for s in starts]))
        with torch.inference_mode():  # the engine's logits are inference tensors
            _apply(logits, parts, prompts)

    def _collect(self, rows: list[int], seqs: list[Sequence],
                 device: torch.device) -> tuple[tuple[_Segments, ...], list[torch.Tensor]]:
        """-> the step's bias, mask, prompt and output segments, and the repetition rows'
        distinct prompt ids (on the device, in the prompt segment's order)."""
        bias = _Segments(2, "ids", "values")  # header (row, n)
        mask = _Segments(2, "ids")  # header (row, n): the ending tokens, under min_tokens
        prompt = _Segments(3)  # header (row, n, repetition): the cached prompt ids
        output = _Segments(5, "ids", "counts")  # header (row, n, repetition, freq, presence)
        prompts = []
        for row, seq in zip(rows, seqs):
            p = seq.sampling
            if p.logit_bias:
                bias.header += (row, len(p.logit_bias))
                bias.entries["ids"] += [entry.token_id for entry in p.logit_bias]
                bias.entries["values"] += [entry.bias for entry in p.logit_bias]
            if len(seq.output_ids) < p.min_tokens:
                ending = p.request_stop_token_ids + ([] if p.ignore_eos else p.stop_token_ids)
                mask.header += (row, len(ending))
                mask.entries["ids"] += ending
            if p.repetition_penalty == 1.0 and not (p.frequency_penalty or p.presence_penalty):
                continue
            counts = self._counts(seq)
            # Every penalized row takes all three over its output: a penalty of 1 divides or
            # multiplies by 1, and 0 subtracts 0, which leave each value's bits as they were.
            output.header += (row, len(counts), p.repetition_penalty, p.frequency_penalty,
                              p.presence_penalty)
            output.entries["ids"] += counts.keys()
            output.entries["counts"] += counts.values()
            if p.repetition_penalty != 1.0:  # CTRL's: the prompt's tokens too
                prompts.append(self._prompt_ids(seq, device))
                prompt.header += (row, len(prompts[-1]), p.repetition_penalty)
        return (bias, mask, prompt, output), prompts

    def _counts(self, seq: Sequence) -> Counter:
        history = self._histories.setdefault(seq.request_id, _History())
        if history.num_counted < len(seq.output_ids):  # usually the one token sampled last
            history.counts.update(seq.output_ids[history.num_counted:])
            history.num_counted = len(seq.output_ids)
        return history.counts

    def _prompt_ids(self, seq: Sequence, device: torch.device) -> torch.Tensor:
        history = self._histories[seq.request_id]
        if history.prompt_ids is None:  # once per request: its distinct prompt ids
            history.prompt_ids = torch.tensor(sorted(set(seq.prompt_ids)),
                                              dtype=torch.int64).to(device)
        return history.prompt_ids


def _apply(logits: torch.Tensor, parts: list, prompts: list[torch.Tensor]) -> None:
    """In place, in the documented order. parts: (per-entry header, entry lists) of the bias,
    mask, prompt and output segments; prompts: the repetition rows' distinct prompt ids. A
    row's ids are distinct within the bias and within its output, so each such entry is read
    and written once; a token in both a prompt and its output is listed twice in the
    repetition, and both entries read the same value and write the same result."""
    (bias_rows, (bias_ids, bias_values)), (mask_rows, (mask_ids,)), (prompt_rows, _), \
        (output_rows, (output_ids, output_counts)) = parts
    if len(bias_ids):
        where = (bias_rows[:, 0].long(), bias_ids.long())
        logits[where] = logits[where] + bias_values
    if len(mask_ids):
        logits[mask_rows[:, 0].long(), mask_ids.long()] = float("-inf")
    if not len(output_ids) and not prompts:
        return
    seen = (torch.cat([prompt_rows[:, 0], output_rows[:, 0]]).long(),
            torch.cat([*prompts, output_ids.long()]))
    penalty = torch.cat([prompt_rows[:, 2], output_rows[:, 2]])
    x = logits[seen]
    logits[seen] = torch.where(x > 0, x / penalty, x * penalty)
    if len(output_ids):  # as vLLM: x - frequency * count, then - presence
        where = (output_rows[:, 0].long(), output_ids.long())
        logits[where] = logits[where] - output_rows[:, 3] * output_counts - output_rows[:, 4]
