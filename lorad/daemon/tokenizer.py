"""The model's tokenizer and chat template, as the coordinator uses them to build prompts.

Loads tokenizer.json with `tokenizers` and renders the chat template the way transformers'
`apply_chat_template` does (same sandbox, globals and filters; encoded without special tokens),
except that what the client sent (content, tools, tool calls) is text: a special-token string
typed in it is encoded as ordinary tokens, so only the template's own markers are control tokens.
Does not decode incrementally: that is detokenizer.py.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from lorad.config.errors import ConfigError

# The named special tokens transformers passes to every chat template (its special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The chat template refused these messages or failed while rendering them."""


class ModelTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None,
                 special_tokens: dict[str, str]) -> None:
        self._tokenizer = tokenizer
        self.special_tokens = special_tokens  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.chat_template = chat_template
        self._template = _compile(chat_template) if chat_template is not None else None
        eos = special_tokens.get("eos_token")
        self.eos_token_id: int | None = tokenizer.token_to_id(eos) if eos else None
        added = tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        strings = sorted({added[i].content for i in self._special_ids}, key=len, reverse=True)
        # Longest first, so a token that another one starts with is not matched short.
        self._special_pattern = re.compile("|".join(map(re.escape, strings))) if strings else None
        # A second tokenizer that reads special-token strings as text. Two instances, not the
        # shared flag toggled per call, so no encode can see the other's setting.
        self._text_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._text_tokenizer.encode_special_tokens = True

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelTokenizer":
        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"--model {model_dir}: no tokenizer.json in that folder "
                              "(lorad needs a fast tokenizer file)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception for any bad file
            raise ConfigError(f"--model {model_dir}: cannot load tokenizer.json: {exc}") from None
        tokenizer.no_truncation()
        tokenizer.no_padding()
        config = _read_json(folder / "tokenizer_config.json")
        special = _special_tokens(config, _read_json(folder / "special_tokens_map.json"))
        try:
            return cls(tokenizer, _find_chat_template(folder, config), special)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"--model {model_dir}: the chat template does not compile: "
                              f"{exc}") from None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """A completions prompt: the tokenizer's own special tokens (e.g. BOS) are added."""
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """tools: Hugging Face's convention, [{"type": "function", "function": {...}}] or None."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=True, **self.special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from None
        except Exception as exc:  # a template is untrusted code running on user input
            raise ChatTemplateError(
                f"chat template error: {type(exc).__name__}: {exc}") from None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The rendered conversation's ids; special ids only where the template writes them.

        Every string the client sent (content, tool calls' arguments, tool definitions, keys
        included) is escaped before rendering (each special-token string becomes a sentinel no
        user can type), so every special-token string left in the rendered text is the
        template's. The text between those is encoded with the sentinels restored, as text.
        """
        escape = _ContentEscape(self._special_pattern, [messages, tools])
        text = self.render_chat(escape.apply(messages), escape.apply(tools))
        # The template writes the special tokens itself, so none are added (as transformers does).
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        if not escape.num_escaped:
            return encoding.ids
        ids: list[int] = []
        start = 0  # where the text after the last template special token begins
        for token_id, (begin, end) in zip(encoding.ids, encoding.offsets):
            if token_id in self._special_ids:
                ids += self._encode_text(escape.restore(text[start:begin]))
                ids.append(token_id)
                start = end
        ids += self._encode_text(escape.restore(text[start:]))
        return ids

    def _encode_text(self, text: str) -> list[int]:
        return self._text_tokenizer.encode(text, add_special_tokens=False).ids if text else []


class _ContentEscape:
    """Swaps special-token strings in a request's strings for sentinels and back.

    A sentinel is private-use characters around a random number and the string's index: no
    string of the request holds it (checked), and case filters, trim or tojson leave it whole.
    """

    def __init__(self, special_pattern: re.Pattern | None, request: object) -> None:
        self._find = special_pattern
        self._strings: list[str] = []  # the escaped strings, by sentinel index
        strings = list(_strings_in(request))
        while True:
            self._nonce = str(secrets.randbelow(10 ** 12))
            if not any(f"\ue000{self._nonce}." in s for s in strings):
                break
        self._sentinel = re.compile(f"\ue000{self._nonce}\\.(\\d+)\ue001")

    @property
    def num_escaped(self) -> int:
        return len(self._strings)

    def apply(self, value):
        """value with every string in it escaped, at any depth (dict keys too)."""
        if self._find is None:
            return value
        if isinstance(value, str):
            return self._find.sub(self._escape, value)
        if isinstance(value, dict):
            return {self.apply(k): self.apply(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.apply(v) for v in value]
        return value

    def restore(self, text: str) -> str:
        return self._sentinel.sub(lambda m: self._strings[int(m.group(1))], text)

    def _escape(self, match: re.Match) -> str:
        self._strings.append(match.group())
        return f"\ue000{self._nonce}.{len(self._strings) - 1}\ue001"


def _strings_in(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings_in(k)
            yield from _strings_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings_in(v)


def _compile(source: str) -> jinja2.Template:
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


def _special_tokens(config: dict, special_map: dict) -> dict[str, str]:
    found = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name, special_map.get(name))
        if isinstance(value, dict):  # the AddedToken spelling: {"content": "<s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def _find_chat_template(folder: Path, config: dict) -> str | None:
    # As transformers does: a chat_template.jinja file wins over the entry in tokenizer_config.json.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
