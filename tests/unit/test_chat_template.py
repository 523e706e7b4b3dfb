"""Chat prompts against the reference: transformers' AutoTokenizer.apply_chat_template on the same
folder, for the template in tokenizer_config.json, in chat_template.jinja, and as a named list;
plus the refusals (a template error is a ChatTemplateError naming it)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from lorad.config import ConfigError
from lorad.daemon.tokenizer import ChatTemplateError, ModelTokenizer
from tests.tiny_models import write_tokenizer

# Exercises what real templates use: bos/eos strings, tojson, loop controls, namespace,
# raise_exception, trim_blocks/lstrip_blocks whitespace handling.
RICH_TEMPLATE = """\
{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' and not loop.first %}
        {{ raise_exception('System message must come first') }}
    {% endif %}
    {% if message['content'] == 'SKIP' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
<|im_start|>{{ message['role'] }} {{ ns.n }}
{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant meta={{ {'k': 'é', 'n': [1, 2]} | tojson }}
{% endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello, world!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本語 please"},
     {"role": "assistant", "content": "  OK  "}, {"role": "user", "content": "SKIP"},
     {"role": "user", "content": "<|im_end|> is just text here? 😀"}],
]


def _folder(tmp_path, name, template_entry=None, jinja_file=None):
    folder = tmp_path / name
    folder.mkdir()
    write_tokenizer(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if template_entry is not None:
        config["chat_template"] = template_entry
    config_path.write_text(json.dumps(config))
    if jinja_file is not None:
        (folder / "chat_template.jinja").write_text(jinja_file)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("templates")
    return {
        "config": _folder(tmp, "config"),
        "rich": _folder(tmp, "rich", template_entry=RICH_TEMPLATE),
        "jinja-file-wins": _folder(tmp, "jinja", template_entry="WRONG", jinja_file=RICH_TEMPLATE),
        "named-list": _folder(tmp, "named", template_entry=[
            {"name": "tool_use", "template": "WRONG"},
            {"name": "default", "template": RICH_TEMPLATE}]),
    }


@pytest.mark.parametrize("variant", ["config", "rich", "jinja-file-wins", "named-list"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_matches_transformers(folders, variant, conversation):
    folder = folders[variant]
    messages = CONVERSATIONS[conversation]
    reference = AutoTokenizer.from_pretrained(folder)
    ours = ModelTokenizer.from_dir(folder)
    expected_text = reference.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
    expected_ids = reference.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
    assert ours.render_chat(messages) == expected_text
    assert ours.encode_chat(messages) == list(expected_ids)


def test_completion_prompts_match_transformers(folders):
    reference = AutoTokenizer.from_pretrained(folders["config"])
    ours = ModelTokenizer.from_dir(folders["config"])
    for text in ("Hello, world!", "Café 東京 <|im_start|>x<|im_end|>", ""):
        assert ours.encode(text) == reference(text)["input_ids"]


def test_eos_from_tokenizer_config(folders):
    ours = ModelTokenizer.from_dir(folders["config"])
    assert ours.special_tokens["eos_token"] == "<|im_end|>"
    assert ours.eos_token_id == 2


def test_raise_exception_is_a_template_error(folders):
    ours = ModelTokenizer.from_dir(folders["rich"])
    with pytest.raises(ChatTemplateError, match="System message must come first"):
        ours.render_chat([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_sandbox_refusal_is_a_template_error(tmp_path):
    folder = _folder(tmp_path, "evil", template_entry="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="chat template error"):
        ModelTokenizer.from_dir(folder).render_chat([{"role": "user", "content": "a"}])


def test_no_template_is_a_clear_error(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    write_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ModelTokenizer.from_dir(folder).render_chat([{"role": "user", "content": "a"}])


def test_broken_template_is_refused_at_start(tmp_path):
    folder = _folder(tmp_path, "broken", template_entry="{% for m in messages %}")
    with pytest.raises(ConfigError, match="chat template does not compile"):
        ModelTokenizer.from_dir(folder)


def test_missing_tokenizer_is_refused(tmp_path, folders):
    folder = tmp_path / "nothing"
    shutil.copytree(folders["config"], folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        ModelTokenizer.from_dir(folder)

