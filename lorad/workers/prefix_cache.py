"""Prefix caching's keys: the chain hash of every full KV block of a sequence, rooted in its
adapter's identity key, so that equal tokens under different identities never share a block.

A block's hash is blake2b over its parent's hash and its token ids; the first block's parent is
the root of the sequence's adapter identity key (adapter_key.py: the factor bytes, module set and
final scales), the base model's root being the key "". Two names registered on byte-identical
folders at the same strength have one key and so share blocks; a reload with other bytes or
another strength gets another key and shares nothing. Pure functions and per-sequence
bookkeeping; which block holds which hash is block_manager.py's, when to look up and register
the planner's.
"""

from __future__ import annotations

import hashlib
from array import array

from lorad.workers.sequence import Sequence

_DOMAIN = b"lorad prefix cache v1\0"


def root_hash(adapter_key: str) -> bytes:
    """The parent of a sequence's first block: its adapter identity key's ("" for the base)."""
    return hashlib.blake2b(_DOMAIN + adapter_key.encode(), digest_size=16).digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash of a full block with these tokens after the block hashed `parent`."""
    return hashlib.blake2b(parent + array("I", token_ids).tobytes(), digest_size=16).digest()


def extend_hashes(seq: Sequence, num_blocks: int, block_size: int) -> list[bytes]:
    """seq.block_hashes grown to cover its first num_blocks full blocks (of prompt + output
    tokens; the caller keeps num_blocks * block_size within them); -> that list."""
    hashes = seq.block_hashes
    parent = hashes[-1] if hashes else root_hash(seq.adapter_key)
    for i in range(len(hashes), num_blocks):
        parent = block_hash(parent, seq.token_slice(i * block_size, (i + 1) * block_size))
        hashes.append(parent)
    return hashes
