"""Generate the tiny text corpus and byte-level BPE tokenizer shipped in ``titan_ext/titan/assets``.

Nothing is downloaded: the corpus is produced by a seeded generator of short English-like texts
(stories, arithmetic facts, lists, pipeline-training log lines) that has enough structure for a
language model's loss to fall within a few dozen steps, and the tokenizer is trained on it with the
``tokenizers`` library (a TorchTitan dependency). The generated files are committed; regenerate with

    python -m titan_ext.titan.assets_gen            # rewrites assets/corpus.jsonl and assets/tokenizer/

The output is deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
CORPUS_PATH = ASSETS_DIR / "corpus.jsonl"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"

# llama3 "debugmodel" has vocab_size=2048; the tokenizer must fit inside it.
VOCAB_SIZE = 2000
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"

_NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Leslie", "Frances", "John",
          "Margaret", "Ken", "Dennis", "Radia", "Vint", "Shafi", "Tony", "Niklaus", "Fran"]
_PLACES = ["the lab", "the harbor", "the old mill", "the library", "the data center", "the garden",
           "the station", "the market", "the bridge", "the observatory", "the workshop"]
_OBJECTS = ["a lantern", "a map", "a notebook", "a compass", "a kettle", "a cable", "a basket",
            "a key", "a ledger", "a clock", "a spool of wire", "a jar of honey"]
_ADJ = ["quiet", "bright", "slow", "busy", "cold", "narrow", "old", "curious", "patient", "tired"]
_VERBS = [("found", "find"), ("carried", "carry"), ("repaired", "repair"), ("lost", "lose"),
          ("painted", "paint"), ("measured", "measure"), ("opened", "open"), ("sold", "sell")]
_WEATHER = ["rain", "fog", "sunshine", "wind", "snow", "a storm"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                 "ten", "eleven", "twelve"]


def _story(rng: random.Random) -> str:
    who, other = rng.sample(_NAMES, 2)
    place, place2 = rng.sample(_PLACES, 2)
    obj = rng.choice(_OBJECTS)
    adj = rng.choice(_ADJ)
    past, base = rng.choice(_VERBS)
    weather = rng.choice(_WEATHER)
    lines = [
        f"{who} walked to {place} on a {adj} morning.",
        f"There was {weather} over {place}, so {who} waited near the door.",
        f"At noon {who} {past} {obj}.",
        f"{other} asked {who}: why did you {base} {obj}?",
        f"{who} said that {obj} belonged in {place2}.",
        f"So {who} and {other} went to {place2} together.",
        f"In {place2} they put {obj} on the table and went home.",
    ]
    k = rng.randint(4, len(lines))
    return " ".join(lines[:k])


def _arithmetic(rng: random.Random) -> str:
    facts = []
    for _ in range(rng.randint(3, 8)):
        a, b = rng.randint(0, 6), rng.randint(0, 6)
        if rng.random() < 0.5:
            facts.append(f"{_NUMBER_WORDS[a]} plus {_NUMBER_WORDS[b]} is {_NUMBER_WORDS[a + b]}.")
        else:
            facts.append(f"{a} + {b} = {a + b}.")
    return " ".join(facts)


def _counting(rng: random.Random) -> str:
    start = rng.randint(0, 40)
    step = rng.choice([1, 2, 3, 5, 10])
    n = rng.randint(5, 12)
    seq = ", ".join(str(start + i * step) for i in range(n))
    return f"Count by {step} from {start}: {seq}."


def _training_log(rng: random.Random) -> str:
    stages = rng.choice([2, 4, 8])
    lines = []
    loss = rng.uniform(6.0, 9.0)
    for step in range(1, rng.randint(4, 9)):
        loss *= rng.uniform(0.85, 0.97)
        it_ms = rng.randint(80, 400)
        lines.append(f"step {step} loss {loss:.2f} iteration {it_ms} ms on {stages} stages.")
    return " ".join(lines)


def _inventory(rng: random.Random) -> str:
    who = rng.choice(_NAMES)
    items = rng.sample(_OBJECTS, rng.randint(2, 5))
    return f"In the basket of {who} there is " + ", ".join(items[:-1]) + f" and {items[-1]}."


_GENERATORS = [(_story, 5), (_arithmetic, 2), (_counting, 2), (_training_log, 1), (_inventory, 2)]


def generate_corpus(num_docs: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic list of documents (one string each)."""
    rng = random.Random(seed)
    gens = [g for g, w in _GENERATORS for _ in range(w)]
    return [rng.choice(gens)(rng) for _ in range(num_docs)]


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE trained on ``texts`` (tokenizers library, deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_assets(out_dir: Path = ASSETS_DIR, num_docs: int = 2000, seed: int = 0) -> None:
    out_dir = Path(out_dir)
    (out_dir / "tokenizer").mkdir(parents=True, exist_ok=True)
    docs = generate_corpus(num_docs, seed)
    with open(out_dir / "corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    tok = train_tokenizer(docs)
    tok.save(str(out_dir / "tokenizer" / "tokenizer.json"))
    # TorchTitan's HuggingFaceTokenizer reads bos/eos from tokenizer_config.json.
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": True,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(out_dir / "tokenizer" / "tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ASSETS_DIR)
    p.add_argument("--num-docs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    write_assets(a.out, a.num_docs, a.seed)
    print(f"wrote {a.out}/corpus.jsonl and {a.out}/tokenizer/")


if __name__ == "__main__":
    main()
