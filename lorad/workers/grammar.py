"""The leader's grammar matchers: one llguidance matcher per constrained sequence, its token mask
applied to that sequence's row of logits before sampling, then advanced with the sampled token.

A completed grammar allows only the request's stop tokens, so the planner ends the sequence with
"stop" on every rank without knowing of grammars (followers never build matchers). Rows without a
grammar are never written. The same code masks CPU and CUDA logits: the bitmask is filled on the
host and reaches the device in one copy. The fill for a step starts (prepare) as soon as its rows
are planned, on a thread of its own (llguidance drops the GIL while it computes), so it runs
while the forward does and mask only joins it; the matchers were advanced with the previous
step's tokens before this step was planned.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from lorad.config import ModelConfig

log = logging.getLogger("lorad.worker")

BITS_PER_WORD = 32  # llguidance's bitmask: int32 words, token t is bit t % 32 of word t // 32


class GrammarRows:
    def __init__(self, model_dir: str) -> None:
        self._model_dir = model_dir
        self._vocab_size = 0  # the model's vocabulary (the logits' width), read with the tokenizer
        self._tokenizers: dict[tuple[int, ...], object] = {}  # LLTokenizer by stop token ids
        self._matchers: dict[str, object] = {}  # LLMatcher by request id
        self._stop_ids: dict[str, list[int]] = {}
        self._executor = None  # LLExecutor, its threads started at the first mask
        self._filler: ThreadPoolExecutor | None = None  # runs prepare's fills, one at a time
        # prepare's fill: (the step's request ids, its constrained rows, bitmask, its Future)
        self._pending: tuple[list[str], list, torch.Tensor, Future] | None = None

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, grammar: str, stop_token_ids: list[int]) -> None:
        # llguidance is imported at the first constrained request, so a worker whose environment
        # lacks it (the GPU image's PYTHONPATH) still serves every unconstrained one.
        from llguidance import LLMatcher

        try:
            matcher = LLMatcher(self._tokenizer(tuple(stop_token_ids)), grammar, log_level=0)
        except Exception as exc:  # a tokenizer llguidance cannot read: fail this request only
            log.error("request %r: no matcher (%s); ending it at once", request_id, exc)
            matcher = None
        if matcher is not None and matcher.is_error():  # validated, so a tokenizer clash
            log.error("request %r: grammar refused by the matcher, ending it at once: %s",
                      request_id, matcher.get_error())
        # None or a matcher in error: only the stop tokens are allowed, so every rank ends the
        # sequence the same way (a leader-only refusal would split the live sets).
        self._matchers[request_id] = matcher
        self._stop_ids[request_id] = list(stop_token_ids)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._stop_ids.pop(request_id, None)

    def prepare(self, request_ids: list[str]) -> None:
        """Start filling the bitmask of a step whose sampled rows are request_ids, on the fill
        thread, so it runs beside the forward; mask() with the same ids joins it."""
        self._pending = None
        rows = self._rows(request_ids)
        if not rows or not self._vocab_size:  # no tokenizer read: mask fills by the logits
            return
        if self._filler is None:
            self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorad-grammar")
        bitmask = self._bitmask(len(rows))
        self._pending = (list(request_ids), rows, bitmask,
                         self._filler.submit(self._fill, rows, bitmask))

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Set the disallowed tokens of each constrained row of logits ([num_sampled, vocab],
        row i is request_ids[i]) to -inf, in place; other rows keep their bits. Joins the fill
        prepare() started for these ids, or fills now."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[3].result()  # joined either way: a matcher is never filled on two threads
        if pending is not None and pending[0] == request_ids:
            _, rows, bitmask, _ = pending
        else:
            rows = self._rows(request_ids)
            if not rows:
                return
            bitmask = self._bitmask(len(rows), logits.shape[1])
            self._fill(rows, bitmask)
        for j, (i, matcher) in enumerate(rows):
            if matcher is None or matcher.is_error():  # nothing sensible is left to allow
                bitmask[j] = _only(self._stop_ids[request_ids[i]], bitmask.shape[1])
        with torch.inference_mode():  # the engine's logits are inference tensors
            logits.masked_fill_(self._disallowed(bitmask, [i for i, _ in rows], logits),
                                float("-inf"))

    def _rows(self, request_ids: list[str]) -> list[tuple[int, object]]:
        """(row, matcher or None) of each constrained row, in row order."""
        if not self._matchers:
            return []
        return [(i, self._matchers[r]) for i, r in enumerate(request_ids) if r in self._matchers]

    def _bitmask(self, num_rows: int, width: int = 0) -> torch.Tensor:
        words = -(-(self._vocab_size or width) // BITS_PER_WORD)
        return torch.zeros(num_rows, words, dtype=torch.int32)  # [num_constrained, words]

    def _fill(self, rows: list[tuple[int, object]], bitmask: torch.Tensor) -> None:
        """Each constrained row's allowed tokens into its row of bitmask (rows without a
        working matcher are left for mask to set)."""
        matchers = [(m, j) for j, (_, m) in enumerate(rows) if m is not None]
        if not matchers:
            return
        from llguidance.torch import fill_next_token_bitmask_par

        if self._executor is None:
            from llguidance import LLExecutor
            self._executor = LLExecutor()
        fill_next_token_bitmask_par(self._executor, matchers, bitmask)

    @staticmethod
    def _disallowed(bitmask: torch.Tensor, row_index: list[int],
                    logits: torch.Tensor) -> torch.Tensor:
        """-> [num_sampled, vocab] bool on the logits' device, True where a token is refused:
        only in the constrained rows (row_index), and past the tokenizer's last word. One
        in-place masked_fill_ with it leaves every other value's bits as they were."""
        num_rows, width = logits.shape
        num_masked = min(width, bitmask.shape[1] * BITS_PER_WORD)
        disallowed = torch.zeros(num_rows, width, dtype=torch.bool, device=logits.device)
        if logits.device.type == "cpu":  # numpy's unpack: a tenth of the torch ops' time here
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
            allowed = torch.from_numpy(bits[:, :num_masked].view(np.bool_))
        else:  # the bitmask (1/32 of the mask) crosses to the device, unpacked there
            allowed = unpack(bitmask.to(logits.device, non_blocking=True), num_masked)
        index = torch.tensor(row_index).to(logits.device)
        disallowed[index, :num_masked] = ~allowed
        disallowed[index, num_masked:] = True
        return disallowed

    def advance(self, request_ids: list[str], sampled: list[int]) -> None:
        """Feed each constrained row its sampled token (a stop token ends the grammar too)."""
        if not self._matchers:
            return
        for request_id, token in zip(request_ids, sampled):
            matcher = self._matchers.get(request_id)
            if matcher is None or matcher.is_stopped() or matcher.is_error():
                continue
            if not matcher.consume_token(token):
                log.error("request %r: sampled token %d outside its grammar: %s",
                          request_id, token, matcher.get_error())

    def _tokenizer(self, stop_token_ids: tuple[int, ...]):
        """Built once per set of stop ids (in practice once), at the first constrained
        admission rather than at start-up: ~0.2 s for a 49k vocabulary, paid only if used."""
        tokenizer = self._tokenizers.get(stop_token_ids)
        if tokenizer is None:
            from llguidance import LLTokenizer
            self._vocab_size = ModelConfig.from_dir(self._model_dir).vocab_size
            text = (Path(self._model_dir) / "tokenizer.json").read_text()
            tokenizer = LLTokenizer(text, n_vocab=self._vocab_size,
                                    eos_token=list(stop_token_ids) or None)
            self._tokenizers[stop_token_ids] = tokenizer
        return tokenizer


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [n, words] int32 -> [n, vocab] bool, True where a token is allowed. Plain torch
    ops on the bitmask's device (no compiled helper: nothing compiles on first use)."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [n, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def _only(token_ids: list[int], words: int) -> torch.Tensor:
    """-> [words] int32 bitmask allowing exactly token_ids."""
    row = torch.zeros(words * BITS_PER_WORD, dtype=torch.bool)
    row[token_ids] = True
    weights = torch.tensor([1 << b for b in range(BITS_PER_WORD)], dtype=torch.int64)
    packed = (row.reshape(words, BITS_PER_WORD).long() * weights).sum(-1)  # [words] < 2**32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
