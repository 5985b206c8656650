"""Inspect what the model will be trained on, in one process with no GPU:

    python -m llmtrain.data --config configs/X.yaml [key=value ...] [--n 3] [--json]

Prints rendered rows with the trained-on tokens marked (green on a terminal, [[...]] otherwise),
token counts, truncation and packing statistics; --json prints a machine-readable summary."""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import yaml

from llmtrain.config import Config, ConfigError, load_config
from llmtrain.data import IGNORE, build, check, plural
from llmtrain.losses.policy import GRPOConfig
from llmtrain.losses.preference import DPOConfig
from llmtrain.models.hf import load_tokenizer

RECIPE_CONFIGS = {"dpo": DPOConfig, "grpo": GRPOConfig}  # a recipe's own section -> its Config


def config_class(path: str) -> type[Config]:
    """The Config (sub)class of the recipe whose section the YAML has (configs/demo-dpo.yaml: dpo:)."""
    try:
        raw = yaml.safe_load(open(path)) or {}
    except (OSError, yaml.YAMLError):
        return Config  # load_config names the problem
    return next((cls for key, cls in RECIPE_CONFIGS.items() if isinstance(raw, dict) and key in raw), Config)


def render(ids: list[int], labels: list[int], tokenizer, colour: bool) -> str:
    """Row text with the spans that carry a loss marked."""
    out = []
    for trained, group in itertools.groupby(zip(ids, labels), key=lambda t: t[1] != IGNORE):
        text = tokenizer.decode([i for i, _ in group])
        out.append((f"\x1b[32m{text}\x1b[0m" if colour else f"[[{text}]]") if trained else text)
    return "".join(out)


def summarize(cfg, n: int) -> dict:
    tokenizer = load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    built = build(cfg.data, tokenizer, cfg.train.seed)
    rows = built.train
    sample_rows = [rows[i] for i in range(min(n, len(rows)))] if not cfg.data.streaming else \
        list(itertools.islice(rows.rows(0), n))
    scanned = rows if not cfg.data.streaming else list(itertools.islice(rows.rows(0), 1000))
    num_tokens = trained = real = 0
    for row in scanned:
        ids, labels, pos = list(row["input_ids"]), list(row["labels"]), list(row["position_ids"])
        num_tokens += len(ids)
        real += len(ids) - _pad_tail(ids, labels, pos, tokenizer.pad_token_id)
        trained += sum(1 for x in labels[1:] if x != IGNORE)
    samples = []
    for row in sample_rows:
        ids, labels = [int(x) for x in row["input_ids"]], [int(x) for x in row["labels"]]
        samples.append({"input_ids": ids, "labels": labels, "text": render(ids, labels, tokenizer, False)})
    return {
        "samples": samples,
        "num_examples": built.stats.num_examples,
        "num_rows": len(scanned),
        "num_tokens": num_tokens,
        "trained_tokens": trained,
        "packing_efficiency": real / max(num_tokens, 1),
        "truncated": built.stats.truncated,
        "skipped": built.stats.skipped,
        "skip_reasons": built.stats.reasons,
        "streaming": cfg.data.streaming,
    }


def _pad_tail(ids: list[int], labels: list[int], positions: list[int], pad: int) -> int:
    """Length of the padding that closes a row: its last segment, if made only of ignored pads."""
    start = len(ids) - 1 - int(positions[-1])
    tail = range(start, len(ids))
    if start > 0 and all(ids[i] == pad and labels[i] == IGNORE for i in tail):
        return len(tail)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrain.data", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--n", type=int, default=3, help="rows to show")
    p.add_argument("--json", action="store_true", help="machine-readable summary on stdout")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, config_class(args.config))
        check(cfg.data)
        summary = summarize(cfg, args.n)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
        return 0
    colour = sys.stdout.isatty()
    tokenizer = load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    for i, s in enumerate(summary["samples"]):
        trained = sum(1 for x in s["labels"][1:] if x != IGNORE)
        print(f"--- row {i}: {plural(len(s['input_ids']), 'token')}, {trained} trained")
        print(render(s["input_ids"], s["labels"], tokenizer, colour))
    print(f"--- {plural(summary['num_examples'], 'example')} -> {plural(summary['num_rows'], 'row')} of "
          f"{cfg.data.seq_len} tokens; {plural(summary['trained_tokens'], 'trained token')}; "
          f"packing efficiency {summary['packing_efficiency']:.1%}; "
          f"{summary['truncated']} truncated; {summary['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
