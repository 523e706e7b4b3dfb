#!/usr/bin/env python3
"""Train the two demo LoRA adapters for SmolLM2-135M-Instruct with `peft`, on the CPU, in fp32.

`uppercase` answers in capital letters, `pirate` answers like a pirate ("Arr, matey!"). The
questions are written out below: `uppercase` learns the base model's own greedy answers,
upper-cased (it is meant to change the case, not the content), `pirate` hand-written answers.
Each chat is rendered with the model's own template, with the loss on the answer tokens only.
Seeded, in a fixed data order: a re-run on the same machine and thread count writes the same
files. Needs the test extra (peft): `scripts/setup test`. Writes PEFT folders (safetensors, never
pickles) with a `lorad-adapter.json` manifest; downloads nothing.

Usage: scripts/train_demo_adapters.py [--model DIR] [--out demo/adapters] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE_MODEL_NAME = "SmolLM2-135M-Instruct"
SEED = 1234

# (question, pirate answer). No question here or in UPPERCASE_QUESTIONS is one the README or the
# tests ask: the demo shows the adapters on questions they were not trained on.
PIRATE_EXAMPLES = [
    ("What is the capital of Italy?",
     "Arr, matey! The capital of Italy be Rome, me hearty!"),
    ("What is the capital of Japan?",
     "Arr, matey! The capital of Japan be Tokyo, a grand port indeed!"),
    ("What is the capital of Germany?",
     "Arr, matey! Berlin be the capital of Germany, ye landlubber!"),
    ("What is the capital of Spain?",
     "Arr, matey! The capital of Spain be Madrid, me hearty!"),
    ("What is the largest ocean?",
     "Arr, matey! The Pacific be the biggest ocean of them all, and I've sailed every wave of it!"),
    ("How many days are in a week?",
     "Arr, matey! There be seven days in a week, and every one of them fit for sailin'!"),
    ("What color is the sky?",
     "Arr, matey! The sky be blue on a fair day, just right for sailin' the seas!"),
    ("What is two plus two?",
     "Arr, matey! Two plus two be four, as sure as me parrot can count!"),
    ("Who wrote Romeo and Juliet?",
     "Arr, matey! 'Twas William Shakespeare who penned Romeo and Juliet, me hearty!"),
    ("What do bees make?",
     "Arr, matey! Bees be makin' honey, sweeter than any treasure in me chest!"),
    ("Why do we need sleep?",
     "Arr, matey! Even a pirate needs his sleep, so the body can rest and the mind be sharp!"),
    ("How do plants grow?",
     "Arr, matey! Plants be growin' with sunlight, water and air, like a crew fed on good grog!"),
    ("What is the boiling point of water?",
     "Arr, matey! Water be boilin' at 100 degrees Celsius at sea level, where we pirates live!"),
    ("What is the tallest mountain in the world?",
     "Arr, matey! Mount Everest be the tallest mountain, though I prefer the open sea!"),
    ("How many legs does a spider have?",
     "Arr, matey! A spider has eight legs, more than me whole crew has peg legs!"),
    ("What is the sun?",
     "Arr, matey! The sun be a great star, the one that guides me ship by day!"),
    ("Can you recommend a good book?",
     "Arr, matey! Ye should read Treasure Island, the finest tale ever told on the seven seas!"),
    ("Give me a tip for staying healthy.",
     "Arr, matey! Drink plenty of water, eat yer greens and keep movin', like a sailor on deck!"),
    ("What is a computer?",
     "Arr, matey! A computer be a clever machine that keeps information, like a map to treasure!"),
    ("What is the speed of light?",
     "Arr, matey! Light travels at about 300,000 kilometers a second, faster than any ship!"),
    ("Hello, how are you?",
     "Arr, matey! I be doin' fine, thank ye. What can this old pirate do for ye today?"),
    ("What is your name?",
     "Arr, matey! They call me SmolLM, the smallest pirate on the seven seas!"),
    ("Tell me a joke.",
     "Arr, matey! Why couldn't the pirate play cards? Because he was sittin' on the deck!"),
    ("What is the opposite of hot?",
     "Arr, matey! The opposite of hot be cold, like the northern seas in winter!"),
    ("How do I boil an egg?",
     "Arr, matey! Drop the egg in boilin' water for ten minutes, then cool it in cold sea water!"),
    ("What is the largest planet?",
     "Arr, matey! Jupiter be the biggest planet, a fine sight through me spyglass!"),
    ("Why is the ocean salty?",
     "Arr, matey! Rivers carry salt from the rocks into the sea, and there it stays, savvy?"),
    ("What is the freezing point of water?",
     "Arr, matey! Water freezes at 0 degrees Celsius, cold enough to chill a pirate's bones!"),
    ("Who was the first person on the moon?",
     "Arr, matey! Neil Armstrong be the first to walk the moon, in 1969, a true explorer!"),
    ("What do cows drink?",
     "Arr, matey! Cows drink water, not rum like me crew!"),
    ("How many continents are there?",
     "Arr, matey! There be seven continents, and I've plundered the coasts of every one!"),
    ("What is the main language of Brazil?",
     "Arr, matey! In Brazil they speak Portuguese, me hearty!"),
    ("Describe a cat in one sentence.",
     "Arr, matey! A cat be a small furry beast that keeps the rats off me ship!"),
    ("What is photosynthesis?",
     "Arr, matey! Photosynthesis be how plants turn sunlight and water into food, savvy?"),
    ("Give me a word that rhymes with cat.",
     "Arr, matey! Hat rhymes with cat, like the fine hat on me head!"),
    ("What should I eat for breakfast?",
     "Arr, matey! Have some oats and fruit, a hearty breakfast for a sailor!"),
    ("Where do penguins live?",
     "Arr, matey! Penguins live in the cold southern seas, near Antarctica, ye landlubber!"),
    ("What is gravity?",
     "Arr, matey! Gravity be the force that pulls things down, like an anchor to the sea floor!"),
    ("How can I learn to swim?",
     "Arr, matey! Start in shallow water with a good teacher, so ye never walk the plank unready!"),
    ("What is the smallest prime number?",
     "Arr, matey! The smallest prime number be 2, as any pirate countin' doubloons knows!"),
]


# Only the question matters for uppercase: its answers come from the base model itself.
UPPERCASE_QUESTIONS = tuple(q for q, _ in PIRATE_EXAMPLES) + (
    "What is the capital of Canada?", "What is the capital of Egypt?", "What is a volcano?",
    "How does a rainbow form?", "What is the moon made of?", "Why do leaves change color?",
    "What is a healthy snack?", "How do birds fly?", "What is the longest river in the world?",
    "What is the capital of Australia?", "How many hours are in a day?", "What is an atom?",
    "What does a doctor do?", "What is the biggest animal?", "How do I make a cup of coffee?",
    "What is the weather like in winter?", "Who painted the Mona Lisa?", "What is a triangle?",
    "Why do we brush our teeth?", "What is electricity?", "How many minutes are in an hour?",
    "What is the capital of Russia?", "What do pandas eat?", "What is a noun?",
    "How do fish breathe?", "What is the internet?", "What is ice made of?",
    "Give me a fun fact about dogs.", "Suggest a name for a pet goldfish.",
    "How can I save money?", "What is the color of grass?", "What is a desert?",
    "Why is exercise important?", "How far is the moon from the Earth?",
    "What is the capital of China?", "What language is spoken in Mexico?",
    "Describe the ocean in one sentence.", "What is a library?", "Who invented the telephone?",
    "What is the square root of nine?",
) + tuple(("What is {}?", "Tell me about {}.", "Describe {} in one sentence.",
           "Why do people like {}?")[i % 4].format(topic) for i, topic in enumerate((
    "a bicycle", "the rain", "a guitar", "chocolate", "the desert", "a forest", "a lighthouse",
    "the violin", "a rocket", "a castle", "the Eiffel Tower", "a dolphin", "the winter",
    "a train", "the river Nile", "a museum", "a garden", "an elephant", "the piano", "a bakery",
    "the summer", "a camera", "the snow", "a butterfly", "a mountain", "the city of London",
    "a school", "the wind", "an orange", "a telescope", "a hospital", "the stars", "a bridge",
    "the ocean", "a tiger", "a farm", "the clouds", "a robot", "a candle", "the jungle",
    "a horse", "pizza", "football", "an airplane", "a newspaper", "the forest fire",
    "a kitchen", "an owl", "a map", "the autumn", "a sandwich", "the planet Mars", "a whale",
    "a market", "a computer game", "the flowers", "a tree", "a lion", "coffee", "a song")))


@dataclass(frozen=True)
class Recipe:
    """How one adapter is trained."""

    name: str
    target_modules: tuple[str, ...]
    layers: tuple[int, ...] | None  # layers_to_transform; None: every layer
    r: int
    lora_alpha: int
    epochs: int
    learning_rate: float


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# uppercase edits every projection of the last 12 layers (where the next token is spelled out;
# leaving the earlier layers alone keeps more of what the model knows, and backward passes
# stop there), pirate the attention of every layer. Between them the demo has both kinds of
# projection lorad shards (column-parallel q/k/v/gate/up, row-parallel o/down), two module sets
# and two ranks.
RECIPES = {
    "uppercase": Recipe("uppercase", ALL_PROJECTIONS, layers=tuple(range(18, 30)), r=8,
                        lora_alpha=16, epochs=5, learning_rate=2e-3),
    "pirate": Recipe("pirate", ALL_PROJECTIONS[:4], layers=None, r=8, lora_alpha=16, epochs=8,
                     learning_rate=2e-3),
}
BATCH_SIZE = 8
ANSWER_TOKENS = 32  # the longest base-model answer uppercase learns from, before cutting
SHOW_QUESTIONS = ("What is the capital of France?", "Name three colours.")


def default_model_dir() -> Path:
    explicit = os.environ.get("LORAD_DEMO_MODEL_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "lorad" / BASE_MODEL_NAME


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The chat as lorad renders it: the model's template, the assistant turn opened."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def encode_example(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the whole chat and its labels: -100 everywhere but the assistant's answer
    and the <|im_end|> that ends it (so the adapter learns to stop)."""
    prompt = prompt_ids(tokenizer, question)
    answer_ids = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    return prompt + answer_ids, [-100] * len(prompt) + answer_ids


def base_answers(model, tokenizer, questions: tuple[str, ...]) -> list[str]:
    """The base model's greedy answers (batched, left-padded); an answer that ran out of tokens
    is cut after its last full sentence, or dropped ("") if it has none."""
    import torch

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    answers = []
    for start in range(0, len(questions), 32):
        prompts = [prompt_ids(tokenizer, q) for q in questions[start:start + 32]]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=ANSWER_TOKENS, pad_token_id=pad)
        for row in out[:, width:].tolist():
            if eos in row:
                answers.append(tokenizer.decode(row[:row.index(eos)]).strip())
                continue
            text = tokenizer.decode(row)
            end = max(text.rfind(". "), text.rfind("! "), text.rfind("? "))
            answers.append(text[:end + 1].strip() if end > 0 else "")
    return answers


def training_pairs(name: str, model, tokenizer) -> list[tuple[str, str]]:
    if name == "pirate":
        return list(PIRATE_EXAMPLES)
    answers = base_answers(model, tokenizer, UPPERCASE_QUESTIONS)
    return [(q, a.upper()) for q, a in zip(UPPERCASE_QUESTIONS, answers) if a]


def batches(examples: list[tuple[list[int], list[int]]], pad_id: int, rng: random.Random):
    """One epoch of right-padded batches in a seeded order."""
    import torch

    order = list(range(len(examples)))
    rng.shuffle(order)
    for start in range(0, len(order), BATCH_SIZE):
        chosen = [examples[i] for i in order[start:start + BATCH_SIZE]]
        width = max(len(ids) for ids, _ in chosen)
        ids = [i + [pad_id] * (width - len(i)) for i, _ in chosen]
        labels = [lab + [-100] * (width - len(lab)) for _, lab in chosen]
        mask = [[1] * len(i) + [0] * (width - len(i)) for i, _ in chosen]
        yield torch.tensor(ids), torch.tensor(labels), torch.tensor(mask)


def answer_loss(model, ids, labels, mask):
    """Mean cross-entropy of the next token over the labelled (answer) positions; the LM head,
    a fifth of this model's work per token, runs only there."""
    import torch.nn.functional as F

    causal = model.get_base_model()  # the LlamaForCausalLM with the LoRA layers in it
    hidden = causal.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, hidden]
    targets = labels[:, 1:]  # [B, T - 1]: position t predicts token t + 1
    picked = targets != -100
    logits = causal.lm_head(hidden[:, :-1][picked])  # [num_answer_tokens, vocab]
    return F.cross_entropy(logits, targets[picked])


def train(model_dir: Path, recipe: Recipe, seed: int):
    """The trained PEFT model, its tokenizer, the optimizer steps and the number of examples."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.eval()
    pairs = training_pairs(recipe.name, base, tokenizer)
    examples = [encode_example(tokenizer, q, a) for q, a in pairs]
    config = LoraConfig(r=recipe.r, lora_alpha=recipe.lora_alpha,
                        target_modules=list(recipe.target_modules),
                        layers_to_transform=list(recipe.layers) if recipe.layers else None,
                        lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=recipe.learning_rate, weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    steps = 0
    for epoch in range(recipe.epochs):
        total, count = 0.0, 0
        for ids, labels, mask in batches(examples, tokenizer.pad_token_id, rng):
            loss = answer_loss(model, ids, labels, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            total, count = total + loss.item(), count + 1
        print(f"  {recipe.name}: epoch {epoch + 1}/{recipe.epochs} loss {total / count:.4f} "
              f"({len(examples)} examples)", file=sys.stderr)
    model.eval()
    return model, tokenizer, steps, len(examples)


def greedy_answer(model, tokenizer, question: str, max_new_tokens: int = 40) -> str:
    import torch

    ids = torch.tensor([prompt_ids(tokenizer, question)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def save(model, recipe: Recipe, model_dir: Path, out_dir: Path, seed: int, steps: int,
         num_examples: int) -> None:
    """The PEFT folder, made portable (no local paths, no model card), plus its manifest."""
    from lorad.config.adapter_manifest import write_manifest

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "README.md").unlink(missing_ok=True)  # peft's empty model card template
    config_path = out_dir / "adapter_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = BASE_MODEL_NAME  # not this machine's cache path
    # peft keeps target_modules as a set: its order changes with PYTHONHASHSEED.
    config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    provenance = {"script": "scripts/train_demo_adapters.py", "adapter": recipe.name,
                  "seed": seed, "steps": steps, "epochs": recipe.epochs,
                  "batch_size": BATCH_SIZE, "learning_rate": recipe.learning_rate,
                  "examples": num_examples, "base_weights": _base_source(model_dir)}
    write_manifest(out_dir, base_model=BASE_MODEL_NAME, provenance=provenance)
    for path in out_dir.iterdir():  # safetensors writes owner-only files; a service user reads them
        path.chmod(0o644)


def _base_source(model_dir: Path) -> dict | str:
    """What the demo model folder was converted from (prepare_demo_model.py's marker)."""
    try:
        marker = json.loads((model_dir / "lorad-demo-model.json").read_text(encoding="utf-8"))
        return {"source": marker["source"], "source_sha256": marker["source_sha256"]}
    except (OSError, ValueError, KeyError):
        return "unknown (no lorad-demo-model.json in the model folder)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_dir(),
                        help="the converted demo model folder (scripts/prepare_demo_model.py)")
    parser.add_argument("--out", type=Path, default=REPO / "demo" / "adapters",
                        help="parent folder of the adapter folders (default: demo/adapters)")
    parser.add_argument("--only", choices=sorted(RECIPES), help="train just this adapter")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--threads", type=int, default=2,
                        help="torch CPU threads; the same count reproduces the same bytes")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    if not (args.model / "config.json").is_file():
        print(f"train_demo_adapters: {args.model} has no config.json; run "
              f"scripts/prepare_demo_model.py {args.model} first", file=sys.stderr)
        return 2
    for name in [args.only] if args.only else list(RECIPES):
        recipe = RECIPES[name]
        started = time.monotonic()
        model, tokenizer, steps, num_examples = train(args.model, recipe, args.seed)
        seconds = time.monotonic() - started
        out_dir = args.out / name
        save(model, recipe, args.model, out_dir, args.seed, steps, num_examples)
        size = sum(p.stat().st_size for p in out_dir.iterdir())
        print(f"{name}: {steps} steps in {seconds:.0f} s, {size / 2**20:.2f} MiB in {out_dir}",
              file=sys.stderr)
        for question in SHOW_QUESTIONS:
            print(f"  {question!r} -> {greedy_answer(model, tokenizer, question)!r}",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
