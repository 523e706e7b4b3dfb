"""The model ids a bench.py run spreads its requests over, and which id each request gets.

Reads and checks a list of ids (a file of one id per line, or --model's commas) and picks one id
per request index: round-robin, or by a Zipf law over the list's order so a few adapters are hot
and many are cold. Each pick depends only on (seed, index), never on the order requests are sent.
Standard library only; knows nothing of HTTP.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path


class ModelListError(ValueError):
    """A model list that cannot be used; the message is one line for the user."""


def read_model_file(path: str) -> list[str]:
    """The ids in `path`, one per line, in order; blank lines and `#` comments are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelListError(f"--models-from-file {path}: cannot read it: {exc}") from None
    ids: list[str] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        model = line.strip()
        if not model or model.startswith("#"):
            continue
        if model in first_line:
            raise ModelListError(f"--models-from-file {path}: line {number} repeats {model!r} "
                                 f"(first on line {first_line[model]})")
        first_line[model] = number
        ids.append(model)
    if not ids:
        raise ModelListError(f"--models-from-file {path}: no model ids in it")
    return ids


def check_served(models: list[str], served: list[str], where: str) -> None:
    """Refuse ids the server does not list, before any load is sent."""
    missing = [m for m in models if m not in set(served)]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelListError(f"{len(missing)} of {len(models)} model ids are not served by "
                             f"{where} (see its /v1/models): {shown}")


class ModelPicker:
    """Which model id request `index` uses. zipf=None: round-robin over the list; zipf=S >= 0:
    id number k (1-based, in list order) with probability proportional to 1 / k**S (S=0 is
    uniform), drawn from a generator seeded by (seed, index)."""

    def __init__(self, models: list[str], zipf: float | None = None, seed: int = 0) -> None:
        if not models:
            raise ModelListError("no model ids to pick from")
        if zipf is not None and not zipf >= 0:  # also refuses NaN
            raise ModelListError(f"--zipf must be 0 or more, got {zipf}")
        self.models = list(models)
        self.zipf = zipf
        self.seed = seed
        weights = [1.0 / k ** (zipf or 0.0) for k in range(1, len(models) + 1)]
        self._cum_weights = list(itertools.accumulate(weights))

    def pick(self, index: int) -> str:
        if self.zipf is None:
            return self.models[index % len(self.models)]
        # A string seed is hashed with SHA-512: the same picks on every Python and platform.
        rng = random.Random(f"bench-zipf:{self.seed}:{index}")
        return rng.choices(self.models, cum_weights=self._cum_weights)[0]

    def describe(self) -> str:
        """The distribution, for the conditions line."""
        if self.zipf is None:
            return f"round-robin over {len(self.models)} model ids"
        return (f"Zipf s={self.zipf:g} over {len(self.models)} model ids in list order, "
                f"seed {self.seed}")
