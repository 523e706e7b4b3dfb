"""The pre-rendered mid-stream chunk (chunk_template.py) against json.dumps of responses.py's
chunk: the same bytes for every format, usage setting, text, count and token ids (with and
without return_token_ids), and no template where the stand-ins cannot be cut out
unambiguously."""

from __future__ import annotations

import json

import pytest

from lorad.daemon.chunk_template import (
    COMPLETION_HOLE, IDS_HOLE, PROMPT_HOLE, TEXT_HOLE, ChunkTemplate, event_bytes)
from lorad.daemon.logprobs import LogprobsFormat
from lorad.daemon.responses import ChatFormat, CompletionFormat

TEXTS = ["", "a", " the", "quote \" and \\ backslash", "\n\t\r\b\f", "\x00\x01\x1f\x7f",
         "é 東京 😀", "\u2028\u2029", "</script>", "{\"json\": [1, 2]}", "\ufffd",
         TEXT_HOLE, json.dumps(TEXT_HOLE), "x" * 5000]
COUNTS = [(1, 0), (16, 1), (7, 123456), (PROMPT_HOLE, COMPLETION_HOLE), (0, 10**30)]
USAGE = [(False, False), (True, False), (True, True), (False, True)]
MODELS = ["tiny", "SmolLM2-135M-Instruct", "mödel/α-\"q\"", "sql"]
TOKEN_IDS = [(), (0,), (7, 128255), (IDS_HOLE,), tuple(range(40)), (PROMPT_HOLE, 3)]


@pytest.mark.parametrize("format_cls", [CompletionFormat, ChatFormat])
@pytest.mark.parametrize("include_usage,continuous", USAGE)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("index", [0, 1, 13])
@pytest.mark.parametrize("return_token_ids", [False, True])
def test_template_bytes_equal_the_full_rendering(format_cls, include_usage, continuous, model,
                                                 index, return_token_ids):
    fmt = format_cls(f"{format_cls.id_prefix}0123abcd", model, include_usage=include_usage,
                     continuous_usage=continuous, return_token_ids=return_token_ids)
    template = ChunkTemplate.of(fmt, index)
    assert template is not None
    for text in TEXTS:
        for num_prompt, num_completion in COUNTS:
            for ids in TOKEN_IDS:
                expected = event_bytes(fmt.chunk(text, None, num_prompt, num_completion,
                                                 index=index, token_ids=ids))
                assert template.render(text, num_prompt, num_completion, ids) == expected


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


def test_token_ids_come_last_in_the_choice_and_only_when_asked():
    for format_cls in (CompletionFormat, ChatFormat):
        asked = format_cls("x-1", "tiny", include_usage=True, continuous_usage=True,
                           return_token_ids=True)
        body = json.loads(ChunkTemplate.of(asked).render("hi", 3, 5, [4, 2])[len(b"data: "):])
        assert list(body["choices"][0])[-1] == "token_ids"
        assert body["choices"][0]["token_ids"] == [4, 2]
        assert body["usage"]["completion_tokens"] == 5
        plain = format_cls("x-1", "tiny")
        body = json.loads(ChunkTemplate.of(plain).render("hi", 3, 5, [4, 2])[len(b"data: "):])
        assert "token_ids" not in body["choices"][0]


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
    # The ids' stand-in inside the model id, with return_token_ids.
    fmt = CompletionFormat("cmpl-1", f"m[{IDS_HOLE}]", return_token_ids=True)
    assert ChunkTemplate.of(fmt) is None
    # The counts' stand-in inside the response id: cutting it out would be ambiguous.
    fmt = CompletionFormat(f"cmpl-{PROMPT_HOLE}", "tiny", include_usage=True,
                           continuous_usage=True)
    assert ChunkTemplate.of(fmt) is None
    # Without usage on every chunk the counts are not holes, so that id is harmless.
    fmt = CompletionFormat(f"cmpl-{PROMPT_HOLE}", "tiny", include_usage=True)
    template = ChunkTemplate.of(fmt)
    assert template.render("x", 1, 2) == event_bytes(fmt.chunk("x", None, 1, 2))
