#!/usr/bin/env python3
"""The two grammar engines lorad could use, llguidance and xgrammar, on lorad's tokenizers (CPU):
tokenizer setup, compile time of JSON schemas, a regex and a grammar, and mask time per token at
batch 1, 8 and 32.

    python -m benchmarks.bench_grammar [--tokenizers PATH,...] [--engines llguidance,xgrammar]
        [--rows MODEL_DIR [--device cuda]]

Each engine that imports is measured (xgrammar is not a lorad dependency: run this from a venv
that has it). Mask time: every row of the batch follows a valid document of its constraint, one
token a step; the figure is the median over steps of filling the whole batch's bitmask (one
LLExecutor call for llguidance; one call per row for xgrammar, its Python API's batch form).
Compile time includes whatever the engine does before the first mask. Prints a table and the
conditions; a benchmark, not a test. --rows times lorad's own mask step (GrammarRows.mask: fill,
unpack, write) at batch 8, 32 and 64 with none, one, half or all rows constrained.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from benchmarks.common import REPO, conditions

DEMO_TOKENIZER = Path.home() / ".cache/lorad/SmolLM2-135M-Instruct/tokenizer.json"
LLAMA3_TOKENIZER = REPO / "scripts/configs/llama3-8b/tokenizer.json"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "items", "status"],
         "properties": {"id": {"type": "integer"},
                        "items": {"type": "array", "minItems": 1, "items": {
                            "type": "object", "additionalProperties": False,
                            "required": ["sku", "qty", "price"],
                            "properties": {"sku": {"type": "string",
                                                   "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                           "qty": {"type": "integer", "minimum": 1},
                                           "price": {"type": "number", "minimum": 0}}}},
                        "status": {"enum": ["open", "paid", "shipped"]}}}
# name -> (kind, constraint, a document it accepts)
CASES = {
    "schema person": ("json", PERSON, json.dumps({"name": "Ada Lovelace", "age": 36,
                                                   "tags": ["math", "poetry"]})),
    "schema order": ("json", ORDER, json.dumps({"id": 7, "items": [
        {"sku": "ABC-123", "qty": 2, "price": 9.5}, {"sku": "XYZ-999", "qty": 1, "price": 120}],
        "status": "paid"})),
    "regex date": ("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}( [a-z]+){1,3}", "2026-12-03 a fine day"),
    "grammar arith": ("grammar", None, "(12 + 3) * 4 - 5 / (6 + 7)"),
}
LARK_ARITH = ('start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\n'
              'factor: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n%ignore " "')
EBNF_ARITH = ('root ::= expr\nexpr ::= term (ws ("+" | "-") ws term)*\n'
              'term ::= factor (ws ("*" | "/") ws factor)*\n'
              'factor ::= [0-9]+ | "(" ws expr ws ")"\nws ::= " "*')
BATCHES = (1, 8, 32)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        self.llg = importlib.import_module("llguidance")
        self.llg_torch = importlib.import_module("llguidance.torch")
        started = time.perf_counter()
        self.tok = self.llg.LLTokenizer(tokenizer_json, eos_token=eos)
        self.setup_s = time.perf_counter() - started
        self.executor = self.llg.LLExecutor()
        self.vocab = self.tok.vocab_size

    @staticmethod
    def grammar(kind: str, constraint) -> str:
        m = importlib.import_module("llguidance").LLMatcher
        return {"json": lambda: m.grammar_from_json_schema(constraint),
                "regex": lambda: m.grammar_from_regex(constraint),
                "grammar": lambda: m.grammar_from_lark(LARK_ARITH)}[kind]()

    def compile(self, kind: str, constraint):
        grammar = self.grammar(kind, constraint)
        matcher = self.llg.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matchers(self, compiled, n: int):
        return [self.llg.LLMatcher(self.tok, compiled) for _ in range(n)]

    def fill(self, matchers, bitmask) -> None:
        self.llg_torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def first_mask(self, compiled) -> None:
        matcher = self.matchers(compiled, 1)[0]
        self.fill([matcher], torch.zeros(1, (self.vocab + 31) // 32, dtype=torch.int32))

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        self.xgr = importlib.import_module("xgrammar")
        hf = importlib.import_module("transformers").PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(tokenizer_json))
        started = time.perf_counter()
        self.info = self.xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=[eos])
        self.setup_s = time.perf_counter() - started  # the HF tokenizer's own load left out
        self.compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.vocab = self.info.vocab_size

    def compile(self, kind: str, constraint):
        c = self.compiler
        return {"json": lambda: c.compile_json_schema(json.dumps(constraint), strict_mode=True),
                "regex": lambda: c.compile_regex(constraint),
                "grammar": lambda: c.compile_grammar(EBNF_ARITH)}[kind]()

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers, bitmask) -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)

    def first_mask(self, compiled) -> None:
        self.fill(self.matchers(compiled, 1), torch.zeros(1, (self.vocab + 31) // 32,
                                                           dtype=torch.int32))

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token), token


def measure(engine_cls, path: Path) -> dict:
    text = path.read_text()
    tokenizer = Tokenizer.from_str(text)
    eos = tokenizer.token_to_id("<|im_end|>") or tokenizer.token_to_id("<|eot_id|>") or 0
    engine = engine_cls(text, eos)
    row = {"tokenizer setup": 1e3 * engine.setup_s}
    for name, (kind, constraint, document) in CASES.items():
        started = time.perf_counter()
        compiled = engine.compile(kind, constraint)
        engine.first_mask(compiled)
        row[f"compile {name}"] = 1e3 * (time.perf_counter() - started)
    for batch in BATCHES:
        row[f"mask b{batch}"] = mask_us(engine, tokenizer, batch)
    return row


def mask_us(engine, tokenizer: Tokenizer, batch: int) -> float:
    """Median µs per step to fill a batch's masks, rows cycling through the cases."""
    cases = list(CASES.values())
    rows = []
    for i in range(batch):
        kind, constraint, document = cases[i % len(cases)]
        ids = tokenizer.encode(document, add_special_tokens=False).ids
        rows.append((engine.matchers(engine.compile(kind, constraint), 1)[0], ids))
    bitmask = torch.zeros(batch, (engine.vocab + 31) // 32, dtype=torch.int32)
    times = []
    for step in range(min(len(ids) for _, ids in rows)):
        started = time.perf_counter()
        engine.fill([m for m, _ in rows], bitmask)
        times.append(time.perf_counter() - started)
        for matcher, ids in rows:
            engine.accept(matcher, ids[step])
    return 1e6 * statistics.median(times)


def rows_us(model_dir: Path, batch: int, num_constrained: int, device: str) -> float:
    """Median µs per step of lorad's GrammarRows.mask (fill, unpack, write the constrained rows)
    on [batch, vocab] fp32 logits, the first num_constrained rows constrained."""
    from lorad.config import ModelConfig
    from lorad.workers.grammar import GrammarRows

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = ModelConfig.from_dir(str(model_dir)).vocab_size
    grammars, cases, docs = GrammarRows(str(model_dir)), list(CASES.values()), {}
    for i in range(num_constrained):
        kind, constraint, document = cases[i % len(cases)]
        grammars.add(f"r{i}", Llguidance.grammar(kind, constraint), [0])
        docs[f"r{i}"] = tokenizer.encode(document, add_special_tokens=False).ids
    ids = [f"r{i}" for i in range(batch)]
    logits = torch.randn(batch, vocab, device=device)
    times = []
    for step in range(min((len(d) for d in docs.values()), default=20)):
        started = time.perf_counter()
        grammars.mask(logits, ids)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        grammars.advance(list(docs), [d[step] for d in docs.values()])
    return 1e6 * statistics.median(times)


def print_rows(model_dir: Path, device: str) -> None:
    print(f"\nlorad's mask step (GrammarRows.mask) on {device}, {model_dir.name}")
    for batch in (8, 32, 64):
        for num in sorted({0, 1, batch // 2, batch}):
            us = rows_us(model_dir, batch, num, device)
            print(f"  batch {batch:3d}, {num:3d} constrained {us:10.1f} µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", default=f"{DEMO_TOKENIZER},{LLAMA3_TOKENIZER}")
    parser.add_argument("--engines", default="llguidance,xgrammar")
    parser.add_argument("--rows", metavar="MODEL_DIR", type=Path,
                        help="also time lorad's own mask step with this model folder's tokenizer")
    parser.add_argument("--device", default="cpu", help="where --rows puts the logits")
    args = parser.parse_args()
    engines = {"llguidance": Llguidance, "xgrammar": Xgrammar}
    print(conditions())
    print(f"torch threads {torch.get_num_threads()}")
    if args.rows:
        print_rows(args.rows, args.device)
    for path in map(Path, args.tokenizers.split(",")):
        for name in args.engines.split(","):
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                print(f"{name}: not installed, skipped")
                continue
            row = measure(engines[name], path)
            print(f"\n{path.parent.name} ({name} {version})")
            for key, value in row.items():
                unit = "µs" if key.startswith("mask") else "ms"
                print(f"  {key:24s} {value:10.2f} {unit}")


if __name__ == "__main__":
    main()
