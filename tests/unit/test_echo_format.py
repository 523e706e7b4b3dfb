"""Completions' echo in OpenAI's shapes (responses.py, daemon/logprobs.py): the text begins with the
prompt's, logprobs cover the prompt's tokens then the generated ones, the first prompt token's
values are null, text offsets point into the echoed text (split characters included); streamed,
each choice's prompt comes in one chunk after its opening chunk; with a list of prompts each
choice echoes its own."""

from __future__ import annotations

from lorad.daemon.logprobs import LogprobsFormat, prompt_offsets
from lorad.daemon.responses import CompletionFormat, FullChoice
from lorad.protocol.messages import TokenLogprobs

# A byte-level vocabulary: each id is some bytes; texts decode with U+FFFD for broken UTF-8.
VOCAB = {1: b"The", 2: b" cat", 3: b" caf", 4: "é".encode()[:1], 5: "é".encode()[1:], 6: b"!",
         7: b" \xe6", 8: b"\x9d\xb1", 9: b"\x99"}


def decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", "replace")


def values(logprob: float, *top: tuple[int, float]) -> TokenLogprobs:
    return TokenLogprobs(logprob, [i for i, _ in top], [v for _, v in top])


PROMPT = [(1, None), (2, values(-1.5, (3, -0.5))), (6, values(-2.0, (6, -2.0)))]
GENERATED = [(2, values(-0.25, (2, -0.25)))]


def completion(*echo: str, logprobs: bool = True) -> CompletionFormat:
    """echo: each prompt's text, by prompt index."""
    return CompletionFormat("cmpl-x", "tiny", echo=list(echo),
                            logprobs=LogprobsFormat(decode, chat=False) if logprobs else None)


def test_a_whole_answer_begins_with_the_prompt_and_its_first_token_has_null_values():
    body = completion("The cat!").full(
        [FullChoice(0, " cat", "length", GENERATED, 0, PROMPT)], 3, 1)
    choice = body["choices"][0]
    assert choice["text"] == "The cat! cat"
    assert choice["logprobs"] == {
        "tokens": ["The", " cat", "!", " cat"],
        "token_logprobs": [None, -1.5, -2.0, -0.25],
        "top_logprobs": [None, {" caf": -0.5, " cat": -1.5}, {"!": -2.0}, {" cat": -0.25}],
        "text_offset": [0, 3, 7, 8]}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_echo_without_logprobs_is_the_text_alone_and_max_tokens_0_the_prompt_alone():
    body = completion("The cat!", logprobs=False).full([FullChoice(0, " cat", "length")], 3, 1)
    assert body["choices"][0]["text"] == "The cat! cat" and body["choices"][0]["logprobs"] is None
    body = completion("The cat!").full([FullChoice(0, "", "length", (), 0, PROMPT)], 3, 0)
    assert body["choices"][0]["text"] == "The cat!"
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 3, 7]
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_stream_sends_the_prompt_in_one_chunk_and_continues_the_offsets():
    fmt = completion("The cat!")
    opening = fmt.opening_chunk(3)["choices"][0]
    assert opening["text"] == "" and opening["logprobs"]["tokens"] == []
    echo = fmt.echo_chunk(3, 0, PROMPT)["choices"][0]
    assert echo["text"] == "The cat!" and echo["finish_reason"] is None
    assert echo["logprobs"]["token_logprobs"] == [None, -1.5, -2.0]
    assert echo["logprobs"]["text_offset"] == [0, 3, 7]
    rest = fmt.chunk(" cat", "length", 3, 1, GENERATED)["choices"][0]
    assert rest["logprobs"]["text_offset"] == [8]


def test_offsets_of_a_prompt_whose_characters_split_over_tokens():
    # "The café" with é in two tokens, then " 東" in two, then a lone continuation byte and "!"
    ids = [1, 3, 4, 5, 7, 8, 9, 6]
    text = decode(ids)
    assert text == "The café 東\ufffd!"
    assert prompt_offsets(decode, ids) == [0, 3, 7, 7, 8, 9, 10, 11]
    assert prompt_offsets(decode, []) == []


def test_an_echoed_text_that_differs_from_the_decoded_prompt_sets_where_generated_tokens_start():
    fmt = completion("The  cat!")  # the prompt as sent; its tokens decode to "The cat!"
    body = fmt.full([FullChoice(0, " cat", "length", GENERATED, 0, PROMPT)], 3, 1)
    assert body["choices"][0]["text"] == "The  cat! cat"
    assert body["choices"][0]["logprobs"]["text_offset"][-1] == len("The  cat!")


SECOND = [(2, None), (6, values(-0.75, (6, -0.75)))]  # " cat!": the second prompt's tokens


def test_each_choice_of_a_prompt_list_echoes_its_own_prompt_with_its_own_offsets():
    fmt = completion("The cat!", " cat!")
    body = fmt.full([FullChoice(0, " cat", "length", GENERATED, 0, PROMPT),
                     FullChoice(1, "!", "length", [(6, values(-0.5))], 1, SECOND)], 5, 2)
    first, second = body["choices"]
    assert (first["index"], first["text"]) == (0, "The cat! cat")
    assert first["logprobs"]["text_offset"] == [0, 3, 7, 8]
    assert (second["index"], second["text"]) == (1, " cat!!")
    assert second["logprobs"]["tokens"] == [" cat", "!", "!"]
    assert second["logprobs"]["token_logprobs"] == [None, -0.75, -0.5]
    assert second["logprobs"]["text_offset"] == [0, 4, 5]


def test_a_stream_of_a_prompt_list_sends_each_choice_its_echo_and_continues_its_offsets():
    fmt = completion("The cat!", " cat!")
    fmt.opening_chunk(5, 0, 1)
    second = fmt.echo_chunk(5, 0, SECOND, 1, 1)["choices"][0]
    assert (second["index"], second["text"]) == (1, " cat!")
    assert second["logprobs"]["text_offset"] == [0, 4]
    fmt.opening_chunk(5, 0, 0)
    first = fmt.echo_chunk(5, 0, PROMPT, 0, 0)["choices"][0]
    assert (first["index"], first["text"]) == (0, "The cat!")
    more = fmt.chunk(" cat", None, 5, 1, GENERATED, 0)["choices"][0]
    assert more["logprobs"]["text_offset"] == [8]
    rest = fmt.chunk("!", "length", 5, 2, [(6, values(-0.5))], 1)["choices"][0]
    assert rest["index"] == 1 and rest["logprobs"]["text_offset"] == [5]
