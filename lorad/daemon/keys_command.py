"""`lorad keys DIR [--coordinator]`: write CURVE key files for --cluster-key-dir.

Every host needs a node pair (node.key, node.secret); node 0 also the coordinator's pair and an
authorized_keys list, which this starts with node 0's own node.key. Copying keys between hosts
is the operator's (docs/operations.md); nothing here overwrites a file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lorad.config.cli import OneLineParser
from lorad.protocol.curve import AUTHORIZED, COORDINATOR, NODE, write_pair


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="lorad keys", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", metavar="DIR", help="the folder to write (created 0700)")
    parser.add_argument("--coordinator", action="store_true",
                        help="node 0: also the coordinator's pair and authorized_keys")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    root = Path(args.dir)
    names = (NODE, COORDINATOR) if args.coordinator else (NODE,)
    existing = [p for n in names for p in (root / f"{n}.key", root / f"{n}.secret")
                if p.exists()]
    if args.coordinator and (root / AUTHORIZED).exists():
        existing.append(root / AUTHORIZED)
    if existing:
        parser.error(f"{existing[0]} exists; lorad keys never overwrites a key (remove it first)")
    try:
        for name in names:
            public, secret = write_pair(root, name)
            print(f"wrote {public} and {secret}")
        if args.coordinator:
            node_key = (root / f"{NODE}.key").read_text()
            (root / AUTHORIZED).write_text(f"# node 0\n{node_key}")
            print(f"wrote {root / AUTHORIZED}: add each other host's {NODE}.key to it")
    except OSError as exc:
        parser.error(f"{args.dir}: {exc}")
    return 0
