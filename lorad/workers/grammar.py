"""The leader's grammar matchers: one llguidance matcher per constrained sequence, its token mask
applied to that sequence's row of logits before sampling, then advanced with the sampled token.

A completed grammar allows only the request's stop tokens, so the planner ends the sequence with
"stop" on every rank without knowing of grammars (followers never build matchers). Rows without a
grammar are never written. The same code masks CPU and CUDA logits: the bitmask is filled on the
host and reaches the device in one copy. Not done yet: filling step k+1's masks while step k runs
(advance right after the draw, then fill into a pinned buffer on LLExecutor's threads while the
next forward runs, joined before its sampling; ids arrive before the next step is planned).
"""

from __future__ import annotations

import logging
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

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Set the disallowed tokens of each constrained row of logits ([num_sampled, vocab],
        row i is request_ids[i]) to -inf, in place; other rows keep their bits."""
        if not self._matchers:
            return
        rows = [(i, self._matchers[r]) for i, r in enumerate(request_ids) if r in self._matchers]
        if not rows:
            return
        from llguidance.torch import fill_next_token_bitmask_par

        if self._executor is None:
            from llguidance import LLExecutor
            self._executor = LLExecutor()
        words = -(-(self._vocab_size or logits.shape[1]) // BITS_PER_WORD)
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)  # [num_constrained, words]
        matchers = [(m, j) for j, (_, m) in enumerate(rows) if m is not None]
        if matchers:
            fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        for j, (i, matcher) in enumerate(rows):
            if matcher is None or matcher.is_error():  # nothing sensible is left to allow
                bitmask[j] = _only(self._stop_ids[request_ids[i]], words)
        with torch.inference_mode():  # the engine's logits are inference tensors
            logits.masked_fill_(self._disallowed(bitmask, [i for i, _ in rows], logits),
                                float("-inf"))

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
