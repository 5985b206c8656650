"""Write the demo's lm-evaluation-harness tasks' data from the fixed facts of scripts/make_demo_assets.py.

Run from anywhere (no network, instant); the output is byte-for-byte reproducible:

    python assets/eval/demo/make_tasks.py

    facts.jsonl   {"context", "choices", "answer"}   demo_facts: multiple choice by log-likelihood
    recall.jsonl  {"context", "answer"}              demo_recall: the same facts and some arithmetic,
                                                     greedy generation, exact match

The contexts are the demo corpus's own sentence openings ("The ball is", "Three plus four is"), so a model
trained on data/demo/train.jsonl (configs/demo.yaml) knows the answers and a random init guesses."""

import importlib.util
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_demo_assets", HERE.parents[2] / "scripts" / "make_demo_assets.py")
world = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(world)


def facts() -> list[dict]:
    """Every fixed fact once: each object's colour, each person's home and favourite colour."""
    rows = [(f"The {o} is", world.COLOURS, c) for o, c in world.OBJECT_COLOUR.items()]
    rows += [(f"{p} lives near the", world.PLACES, h) for p, h in world.HOME.items()]
    rows += [(f"{p} likes the colour", world.COLOURS, c) for p, c in world.FAVOURITE.items()]
    return [{"context": ctx, "choices": choices, "answer": choices.index(right)} for ctx, choices, right in rows]


def arithmetic(n: int = 30) -> list[dict]:
    """Sums and differences in the corpus's words, as the corpus writes them (operands 0..10)."""
    r = random.Random(f"{world.SEED}-eval-arithmetic")
    rows = []
    for _ in range(n):
        a, b = r.randint(0, 10), r.randint(0, 10)
        if r.random() < 0.5:
            rows.append({"context": f"{world.cap(world.NUM[a])} plus {world.NUM[b]} is", "answer": world.NUM[a + b]})
        else:
            rows.append({"context": f"{world.cap(world.NUM[a + b])} minus {world.NUM[b]} is", "answer": world.NUM[a]})
    return rows


def main() -> None:
    mc = facts()
    recall = [{"context": f["context"], "answer": f["choices"][f["answer"]]} for f in mc] + arithmetic()
    for name, rows in (("facts", mc), ("recall", recall)):
        world.write_jsonl(HERE / f"{name}.jsonl", rows)
        print(f"wrote {HERE / name}.jsonl ({len(rows)} rows)")


if __name__ == "__main__":
    main()
