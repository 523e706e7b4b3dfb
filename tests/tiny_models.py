"""Tiny random Llama checkpoints with a small real tokenizer, built at test time (no downloads).

The model is a random `transformers.LlamaForCausalLM` saved as safetensors; the tokenizer is a
byte-level BPE trained on the fixed text below, with SmolLM2's special tokens and a ChatML chat
template. Same arguments, same files.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
TOKENIZER_VOCAB_SIZE = 384
DEFAULT_VOCAB_SIZE = 400  # >= the tokenizer's 384; uneven over 3 ranks (134, 133, 133)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A serving daemon answers requests for one base
language model and many small adapters, chosen per request. Each worker holds a shard of the
weights, a pool of key and value blocks, and runs the same step as every other worker.
Hello, world! How are you today? I am fine, thank you. What is the weather like in Paris?
It is sunny and warm, with a light breeze from the west. The river runs through the old town,
past the market, the library and the station, where trains leave every ten minutes.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024. Dates: 2024-05-17, 1999-12-31.
SELECT name, price FROM products WHERE price > 10 ORDER BY price DESC LIMIT 5;
def add(a, b):
    return a + b
{"name": "lorad", "version": 1, "tags": ["serve", "lora", "llama"]}
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
Once upon a time, there was a little robot who wanted to learn how to paint the sky.
Every morning it watched the sun rise, and every evening it mixed new colours of blue and gold.
Café, naïve, résumé, über, smörgåsbord: words with accents are bytes too. 東京 and 日本語.
"""


def train_tokenizer():
    """A deterministic byte-level BPE over TRAINING_TEXT (a `tokenizers.Tokenizer`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def write_tokenizer(path: Path) -> int:
    """Write tokenizer.json and tokenizer_config.json; returns the tokenizer's vocab size."""
    tokenizer = train_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
         "unk_token": "<|endoftext|>"}, indent=2) + "\n")
    return tokenizer.get_vocab_size()


def make_tiny_llama(path, *, hidden_size: int = 64, intermediate_size: int = 128,
                    num_hidden_layers: int = 2, num_attention_heads: int = 4,
                    num_key_value_heads: int = 2, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    tie_word_embeddings: bool = False, rope_scaling: dict | None = None,
                    max_position_embeddings: int = 256, seed: int = 0,
                    with_tokenizer: bool = True) -> Path:
    """Build a random fp32 Llama checkpoint in `path` (created if needed) and return it.

    rope_scaling: None, or a llama3 dict (rope_type, factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        tokenizer_size = write_tokenizer(path)
        if vocab_size < tokenizer_size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's "
                             f"{tokenizer_size}")
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling is not None:
        rope = {"rope_theta": 10000.0, **rope_scaling}
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=SPECIAL_TOKENS.index("<|im_start|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"), pad_token_id=None,
        # Wider than the default 0.02 so attention is far from uniform and a wrong mask,
        # rotation or head mapping moves the logits well beyond the test tolerance.
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        # Norm weights start at ones; perturb them so a norm applied in the wrong place shows.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn(param.shape))
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_qwen2_moe(path, *, hidden_size: int = 72, intermediate_size: int = 40,
                        num_hidden_layers: int = 3, num_attention_heads: int = 6,
                        num_key_value_heads: int = 3, num_experts: int = 8,
                        num_experts_per_tok: int = 3, moe_intermediate_size: int = 20,
                        shared_expert_intermediate_size: int = 36, norm_topk_prob: bool = False,
                        decoder_sparse_step: int = 1, mlp_only_layers: tuple[int, ...] = (1,),
                        vocab_size: int = DEFAULT_VOCAB_SIZE, tie_word_embeddings: bool = False,
                        max_position_embeddings: int = 256, seed: int = 0,
                        with_tokenizer: bool = True) -> Path:
    """Build a random fp32 Qwen2-MoE checkpoint in `path` (created if needed) and return it:
    routed experts uneven over 3 ranks (20 = 7 + 7 + 6), a dense layer among the sparse ones, and
    every bias, norm and gate perturbed so that one computed in the wrong place shows."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if with_tokenizer and write_tokenizer(path) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's")
    config = Qwen2MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        norm_topk_prob=norm_topk_prob, decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=list(mlp_only_layers), max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=SPECIAL_TOKENS.index("<|im_start|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"), pad_token_id=None,
        initializer_range=0.1)  # wide, as make_tiny_llama's: a wrong route moves the logits
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn(param.shape))
            elif name.endswith(".bias"):  # transformers starts biases at zero
                param.copy_(0.1 * torch.randn(param.shape))
    model.save_pretrained(path, safe_serialization=True)
    return path
