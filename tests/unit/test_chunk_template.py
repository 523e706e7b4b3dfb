"""The pre-rendered mid-stream chunk (chunk_template.py) against json.dumps of responses.py's
chunk: the same bytes for every format, usage setting, text and count, and no template where the
stand-ins cannot be cut out unambiguously."""

from __future__ import annotations

import json

import pytest

from lorad.daemon.chunk_template import (
    COMPLETION_HOLE, PROMPT_HOLE, TEXT_HOLE, ChunkTemplate, event_bytes)
from lorad.daemon.logprobs import LogprobsFormat
from lorad.daemon.responses import ChatFormat, CompletionFormat

TEXTS = ["", "a", " the", "quote \" and \\ backslash", "\n\t\r\b\f", "\x00\x01\x1f\x7f",
         "é 東京 😀", "\u2028\u2029", "</script>", "{\"json\": [1, 2]}", "\ufffd",
         TEXT_HOLE, json.dumps(TEXT_HOLE), "x" * 5000]
COUNTS = [(1, 0), (16, 1), (7, 123456), (PROMPT_HOLE, COMPLETION_HOLE), (0, 10**30)]
USAGE = [(False, False), (True, False), (True, True), (False, True)]
MODELS = ["tiny", "SmolLM2-135M-Instruct", "mödel/α-\"q\"", "sql"]


@pytest.mark.parametrize("format_cls", [CompletionFormat, ChatFormat])
@pytest.mark.parametrize("include_usage,continuous", USAGE)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("index", [0, 1, 13])
def test_template_bytes_equal_the_full_rendering(format_cls, include_usage, continuous, model,
                                                 index):
    fmt = format_cls(f"{format_cls.id_prefix}0123abcd", model, include_usage=include_usage,
                     continuous_usage=continuous)
    template = ChunkTemplate.of(fmt, index)
    assert template is not None
    for text in TEXTS:
        for num_prompt, num_completion in COUNTS:
            expected = event_bytes(fmt.chunk(text, None, num_prompt, num_completion,
                                             index=index))
            assert template.render(text, num_prompt, num_completion) == expected


def test_event_bytes_is_the_sse_form_of_json_dumps():
    payload = {"a": "é", "b": [1, None], "c": {"d": 1.5}}
    assert event_bytes(payload) == ("data: " + json.dumps(payload, ensure_ascii=False)
                                    + "\n\n").encode()


def test_usage_on_every_chunk_changes_with_the_counts():
    fmt = CompletionFormat("cmpl-1", "tiny", include_usage=True, continuous_usage=True)
    template = ChunkTemplate.of(fmt)
    body = json.loads(template.render("hi", 3, 5)[len(b"data: "):])
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert body["choices"][0]["text"] == "hi"


def test_no_template_for_a_format_whose_chunks_keep_state():
    class Counting(ChatFormat):  # as ToolCallFormat: each chunk depends on those before it
        def chunk(self, *args, **kwargs):
            self.calls = getattr(self, "calls", 0) + 1
            return super().chunk(*args, **kwargs)

    fmt = Counting("chatcmpl-1", "tiny")
    assert ChunkTemplate.of(fmt) is None
    assert not hasattr(fmt, "calls")  # and it was not asked to render the stand-ins


def test_no_template_with_logprobs():
    fmt = ChatFormat("chatcmpl-1", "tiny", logprobs=LogprobsFormat(lambda ids: "t", chat=True))
    assert ChunkTemplate.of(fmt) is None


def test_no_template_when_an_id_holds_a_stand_in():
    # The counts' stand-in inside the response id: cutting it out would be ambiguous.
    fmt = CompletionFormat(f"cmpl-{PROMPT_HOLE}", "tiny", include_usage=True,
                           continuous_usage=True)
    assert ChunkTemplate.of(fmt) is None
    # Without usage on every chunk the counts are not holes, so that id is harmless.
    fmt = CompletionFormat(f"cmpl-{PROMPT_HOLE}", "tiny", include_usage=True)
    template = ChunkTemplate.of(fmt)
    assert template.render("x", 1, 2) == event_bytes(fmt.chunk("x", None, 1, 2))
