"""`lorad-adapter.json`: an adapter folder's optional manifest, checked against the files it lists.

    {"format": 1,
     "files": {"adapter_config.json": "<sha256 hex>", "adapter_model.safetensors": "<sha256 hex>"},
     "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",   (optional, free-form)
     "provenance": {...}}                                    (optional, any JSON)

Every listed file must exist in the folder and hash to its entry; the two files lorad reads must
be listed. The manifest says nothing about what the adapter computes: that is the identity key.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from lorad.config.errors import ConfigError

MANIFEST_FILE = "lorad-adapter.json"
MANIFEST_FORMAT = 1
REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIELDS = ("format", "files", "base_model", "provenance")


@dataclass(frozen=True)
class AdapterManifest:
    files: dict[str, str]  # file name in the folder -> sha256 hex
    base_model: str | None
    provenance: object  # free-form JSON, shown by check-adapter, never interpreted


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(folder: Path) -> AdapterManifest | None:
    """The folder's manifest, checked against its files; None when the folder has none."""
    path = folder / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{MANIFEST_FILE}: cannot read: {exc}") from None
    manifest = _from_dict(raw)
    for name, expected in manifest.files.items():
        try:
            actual = file_sha256(folder / name)
        except FileNotFoundError:
            raise ConfigError(f"{MANIFEST_FILE}: files lists {name!r}, which is not in the "
                              "folder") from None
        except OSError as exc:
            raise ConfigError(f"{name}: cannot read: {exc.strerror or exc}") from None
        if actual != expected:
            raise ConfigError(f"{MANIFEST_FILE}: files[{name!r}] is sha256 {expected[:16]}..., "
                              f"but {name} hashes to {actual[:16]}... (changed since the "
                              "manifest was written?)")
    return manifest


def _from_dict(raw) -> AdapterManifest:
    if not isinstance(raw, dict):
        raise ConfigError(f"{MANIFEST_FILE}: expected a JSON object")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{MANIFEST_FILE}: unknown field {unknown[0]!r} (fields: "
                          f"{', '.join(_FIELDS)}; put anything else under provenance)")
    if raw.get("format") != MANIFEST_FORMAT or isinstance(raw.get("format"), bool):
        raise ConfigError(f"{MANIFEST_FILE}: format must be {MANIFEST_FORMAT}, "
                          f"got {raw.get('format')!r}")
    files = raw.get("files")
    if not isinstance(files, dict):
        raise ConfigError(f"{MANIFEST_FILE}: files must be an object of file name -> sha256")
    for name, digest in files.items():
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise ConfigError(f"{MANIFEST_FILE}: files key {name!r} must be a file name in the "
                              "adapter folder")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ConfigError(f"{MANIFEST_FILE}: files[{name!r}] must be 64 lowercase hex "
                              f"digits (sha256), got {digest!r}")
    for name in REQUIRED_FILES:
        if name not in files:
            raise ConfigError(f"{MANIFEST_FILE}: files must list {name}")
    base_model = raw.get("base_model")
    if base_model is not None and not isinstance(base_model, str):
        raise ConfigError(f"{MANIFEST_FILE}: base_model must be a string, got {base_model!r}")
    return AdapterManifest(dict(files), base_model, raw.get("provenance"))


def write_manifest(folder: str | Path, base_model: str | None = None, provenance=None,
                   extra_files: tuple[str, ...] = ()) -> Path:
    """Hash the adapter's files into `folder/lorad-adapter.json` (for scripts and tests)."""
    folder = Path(folder)
    files = {name: file_sha256(folder / name) for name in REQUIRED_FILES + tuple(extra_files)}
    body = {"format": MANIFEST_FORMAT, "files": files}
    if base_model is not None:
        body["base_model"] = base_model
    if provenance is not None:
        body["provenance"] = provenance
    path = folder / MANIFEST_FILE
    path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
