"""A stream's mid-stream chunk event, pre-rendered: the bytes of `data: {chunk}` with holes for
the text, the token ids (return_token_ids) and the counts, cut once per choice from json.dumps of
responses.py's own chunk.

Streaming sends one such event per token, and json.dumps of the whole envelope was most of the
cost of rendering each (docs/performance-log.md: pre-rendered SSE chunks). Only chunks without
a finish reason and without logprobs take this path; every other event is rendered in full.
The bytes equal the full rendering's (tests/unit/test_chunk_template.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from json.encoder import encode_basestring  # json.dumps' own string encoder (ensure_ascii=False)

from lorad.daemon.responses import ChatFormat, CompletionFormat

# Stand-ins rendered into the template and cut out again. The text's JSON form holds escapes
# no served id or request id holds; the ids and counts are checked to appear exactly as expected.
TEXT_HOLE = "\x00lorad-text\x00"
PROMPT_HOLE, COMPLETION_HOLE = 7_340_029_111_317, 8_461_057_222_429
IDS_HOLE = 9_581_063_333_541  # the one id of the stand-in token_ids list


def event_bytes(payload: dict) -> bytes:
    """`data: {json}` and the blank line that ends an SSE event."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def ids_json(token_ids: Sequence[int]) -> str:
    """json.dumps of a list of ints, without its dispatch."""
    return "[" + ", ".join(map(str, token_ids)) + "]"


class ChunkTemplate:
    """render(text, num_prompt, num_completion, token_ids) == event_bytes(fmt.chunk(text, None,
    num_prompt, num_completion, index=index, token_ids=token_ids)) for the format and choice
    index it was cut for."""

    def __init__(self, pieces: list[str], with_ids: bool, with_counts: bool) -> None:
        self._pieces = pieces  # the literal text around the holes, in order
        # The holes are the text, then the ids if with_ids, then prompt, completion and total
        # if with_counts.
        self._with_ids = with_ids
        self._with_counts = with_counts

    @classmethod
    def of(cls, fmt: CompletionFormat, index: int = 0) -> ChunkTemplate | None:
        """The template of fmt's mid-stream chunks of choice `index`; None where they have
        logprobs, where fmt's chunks depend on what came before (tool calls), or where the
        stand-ins cannot be cut out unambiguously: then every chunk is rendered in full."""
        # Exact types only: a subclass's chunk() may keep state (ToolCallFormat's splitter),
        # which rendering the stand-ins through it would disturb.
        if type(fmt) not in (CompletionFormat, ChatFormat) or fmt.logprobs is not None:
            return None
        rendered = event_bytes(fmt.chunk(TEXT_HOLE, None, PROMPT_HOLE, COMPLETION_HOLE,
                                         index=index, token_ids=[IDS_HOLE])).decode()
        holes = [encode_basestring(TEXT_HOLE)]
        if fmt.return_token_ids:
            holes.append(ids_json([IDS_HOLE]))
        if fmt.continuous_usage:
            holes += [str(PROMPT_HOLE), str(COMPLETION_HOLE), str(PROMPT_HOLE + COMPLETION_HOLE)]
        pattern = re.compile("|".join(re.escape(hole) for hole in holes))
        if pattern.findall(rendered) != holes:
            return None
        return cls(pattern.split(rendered), fmt.return_token_ids, fmt.continuous_usage)

    def render(self, text: str, num_prompt: int, num_completion: int,
               token_ids: Sequence[int] = ()) -> bytes:
        p = self._pieces
        rendered = p[0] + encode_basestring(text) + p[1]
        i = 2  # the piece after the next hole
        if self._with_ids:
            rendered += ids_json(token_ids) + p[2]
            i = 3
        if self._with_counts:
            rendered += (str(num_prompt) + p[i] + str(num_completion) + p[i + 1]
                         + str(num_prompt + num_completion) + p[i + 2])
        return rendered.encode()
