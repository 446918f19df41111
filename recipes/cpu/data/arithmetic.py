"""Writes the fine-tuning corpora of recipes/cpu/sft-tiny.yaml and dpo-tiny.yaml (run from the
repository root: python recipes/cpu/data/arithmetic.py): sums of two numbers under 20 asked as
questions, as prompt-completion examples (sft.jsonl) and as preference pairs whose rejected answer is
off by one (pairs.jsonl). Deterministic; nothing is downloaded."""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    rng = random.Random(0)
    sums = [(a, b) for a in range(20) for b in range(20)]
    rng.shuffle(sums)
    with open(HERE / "sft.jsonl", "w") as f:
        for a, b in sums[:300]:
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "completion": f" {a + b}."}) + "\n")
    with open(HERE / "pairs.jsonl", "w") as f:
        for a, b in sums[:200]:
            wrong = a + b + rng.choice((-1, 1))
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "chosen": f" {a + b}.", "rejected": f" {wrong}."})
                    + "\n")


if __name__ == "__main__":
    main()
