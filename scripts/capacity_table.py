"""The step-time table capacity.py simulates from: its JSON format (`lorad-step-table/1`), its
checks, and the time of any step by interpolation. Stdlib only; it measures nothing
(benchmarks/step_table.py and bench_engine.py --json-out write tables; docs/capacity.md).
"""

from __future__ import annotations

import bisect
import json

FORMAT = "lorad-step-table/1"


class TableError(ValueError):
    """A step table capacity.py cannot use; the message names the field."""


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through the points (xs ascending), linear beyond either end."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class StepTable:
    """{"format": "lorad-step-table/1", "conditions", "model", "device", "parallel", "context",
    "prefill_chunk", "steps": [{"decode_rows": B, "prefill_tokens": P, "adapters": A,
    "step_ms": t}, ...], "adapter_load_ms": {"host": x, "disk": y}}, A the distinct adapters
    among a step's rows (0: base rows only). A step of B decode rows and P prompt tokens with A
    adapters costs D(B, A) + F(P, A) - c(A), and at least F(B + P, A) (lorad runs a step with a
    prompt chunk on the prompt path, eagerly on a GPU): D from the decode-only steps through
    (0, c), F from the prefill-only ones through their own intercept (a level of one prompt step:
    the nearest line's slope through it; none: through (0, c)), c the decode
    curve's intercept (a level of one decode step borrows the nearest level's), or fitted to the
    mixed steps where the table has some. Each is linear in A between tabled counts (from 0 to
    the next a step: one adapter row turns the LoRA work on) and constant beyond them."""

    def __init__(self, data: dict) -> None:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TableError(f"format: expected {FORMAT!r}, got {data.get('format')!r}"
                             if isinstance(data, dict) else "the table is not a JSON object")
        self.data = data
        steps = data.get("steps")
        if not isinstance(steps, list) or not steps:
            raise TableError("steps: expected a non-empty list")
        decode: dict[int, dict[int, float]] = {}  # adapters -> decode rows -> ms
        prefill: dict[int, dict[int, float]] = {}  # adapters -> prompt tokens -> ms
        mixed: dict[int, list[tuple[int, int, float]]] = {}
        for n, step in enumerate(steps):
            try:
                b, p, a = (int(step[k]) for k in ("decode_rows", "prefill_tokens", "adapters"))
                ms = float(step["step_ms"])
            except (KeyError, TypeError, ValueError) as exc:
                raise TableError(f"steps[{n}]: {exc!r}") from None
            if min(b, p, a) < 0 or b + p == 0 or not ms > 0:
                raise TableError(f"steps[{n}]: counts must be >= 0 with rows or tokens, and "
                                 f"step_ms > 0: {step}")
            if p == 0:
                decode.setdefault(a, {})[b] = ms
            elif b == 0:
                prefill.setdefault(a, {})[p] = ms
            else:
                mixed.setdefault(a, []).append((b, p, ms))
        if not decode:
            raise TableError("steps: no decode-only step (prefill_tokens 0)")
        self.decode = {a: _curve(points) for a, points in sorted(decode.items())}
        self.prefill = {a: _curve(points) for a, points in sorted(prefill.items())}
        # A level of one decode step borrows the intercept of the nearest level with a line.
        lines = {a: _intercept(*c) for a, c in self.decode.items() if len(c[0]) >= 2}
        self.fixed = {}
        for a, (xs, ys) in self.decode.items():
            near = min(lines, key=lambda b: (abs(b - a), b)) if lines else None
            self.fixed[a] = lines.get(a, 0.0 if near is None else min(lines[near], ys[0]))
        for a, points in mixed.items():  # the fixed cost that D + F counts twice, as measured
            if a in self.fixed and self.prefill:
                residual = [self.decode_ms(b, a) + self.prefill_ms(p, a) - ms
                            for b, p, ms in points]
                self.fixed[a] = min(max(sum(residual) / len(residual), 0.0),
                                    self.decode[a][1][0])
        self._memo: dict[tuple[int, int, int], float] = {}
        loads = data.get("adapter_load_ms") or {}
        self.load_ms = {"host": float(loads.get("host", 0.0)),
                        "disk": float(loads.get("disk", loads.get("host", 0.0)))}

    @classmethod
    def from_file(cls, path: str) -> "StepTable":
        try:
            with open(path, encoding="utf-8") as f:
                return cls(json.load(f))
        except (OSError, json.JSONDecodeError) as exc:
            raise TableError(f"{path}: {exc}") from None

    @property
    def on_gpu(self) -> bool:
        """Whether the steps were measured on a GPU (bench_engine's tables name it; the CPU's
        say "cpu, N thread(s)"; a table naming none counts as a CPU's)."""
        device = str(self.data.get("device", "cpu")).lower()
        return not device.startswith("cpu")

    def describe(self) -> str:
        d = self.data
        return (f"{d.get('model', '?')} on {d.get('device', '?')}, --parallel "
                f"{d.get('parallel', 1)}, adapter levels {sorted(self.decode)}; "
                f"{d.get('conditions', '')}")

    def fixed_ms(self, adapters: int) -> float:
        return _across(self.fixed, adapters, lambda a: self.fixed[a])

    def decode_ms(self, rows: int, adapters: int) -> float:
        return _across(self.decode, adapters, lambda a: interpolate(
            [0] + self.decode[a][0], [self.fixed[a]] + self.decode[a][1], rows))

    def prefill_ms(self, tokens: int, adapters: int) -> float:
        if not self.prefill:  # a decode row's cost stands in for a prompt token's
            return self.decode_ms(tokens, adapters)

        lines = [a for a, (xs, _) in self.prefill.items() if len(xs) >= 2]

        def at(a: int) -> float:
            xs, ys = self.prefill[a]
            if len(xs) >= 2:  # through its own intercept
                return interpolate([0] + xs, [_intercept(xs, ys)] + ys, tokens)
            if lines:  # one point: the nearest line's slope through it
                lx, ly = self.prefill[min(lines, key=lambda b: (abs(b - a), b))]
                return ys[0] + (ly[-1] - ly[0]) / (lx[-1] - lx[0]) * (tokens - xs[0])
            return interpolate([0] + xs, [min(self.fixed_ms(a), ys[0])] + ys, tokens)

        return _across(self.prefill, adapters, at)

    def step_ms(self, decode_rows: int, prefill_tokens: int, adapters: int) -> float:
        """Milliseconds of one step; 0 for an empty one. Memoized: a simulation asks for the
        same few shapes millions of times."""
        key = (decode_rows, prefill_tokens, adapters)
        if key not in self._memo:
            self._memo[key] = self._step_ms(*key)
        return self._memo[key]

    def _step_ms(self, decode_rows: int, prefill_tokens: int, adapters: int) -> float:
        d = self.decode_ms(decode_rows, adapters) if decode_rows else 0.0
        f = self.prefill_ms(prefill_tokens, adapters) if prefill_tokens else 0.0
        if decode_rows and prefill_tokens:  # at least the prompt path over all its rows
            return max(d + f - self.fixed_ms(adapters), d,
                       self.prefill_ms(decode_rows + prefill_tokens, adapters))
        return d or f


def _curve(points: dict[int, float]) -> tuple[list[float], list[float]]:
    xs = sorted(points)
    return [float(x) for x in xs], [points[x] for x in xs]


def _intercept(xs: list[float], ys: list[float]) -> float:
    """What a step costs before any row: the line through the two smallest points at 0,
    between 0 and the smallest point's time."""
    return min(max(ys[0] - (ys[1] - ys[0]) * xs[0] / (xs[1] - xs[0]), 0.0), ys[0])


def _across(levels: dict, adapters: int, value) -> float:
    """value(level) linear in the adapter count between the tabled levels, constant beyond; but
    no line from 0 adapters to the next level: one adapter row already runs the LoRA work."""
    counts = sorted(levels)
    if adapters <= counts[0]:
        return value(counts[0])
    if adapters >= counts[-1]:
        return value(counts[-1])
    i = bisect.bisect_right(counts, adapters)
    a0, a1 = counts[i - 1], counts[i]
    if a0 == 0:
        return value(a1)
    v0, v1 = value(a0), value(a1)
    return v0 + (v1 - v0) * (adapters - a0) / (a1 - a0)
