"""Inspect what the model will be trained on, in one process with no GPU, for any recipe's config:

    python -m llmtrain.data --config configs/X.yaml [key=value ...] [--n 3] [--json]

Prints rendered rows with the trained-on tokens marked (green on a terminal, [[...]] otherwise): every part of a row
as its rows kind names them (data.FORMATS' Rows.parts: a packed row; a preference pair's prompt, chosen and
rejected; a prompt, with the columns its reward functions receive), token counts, truncation and packing statistics;
--json prints a machine-readable summary. The config's class is the recipe's (llmtrain.recipes.RECIPES) whose own
sections (dpo:, grpo:) the file or the overrides set."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import yaml

from llmtrain.config import Config, ConfigError, load_config, parse_overrides
from llmtrain.data import IGNORE, build, chat_template, check, plural, rows_kind, vision
from llmtrain.models.hf import check_dir, load_tokenizer
from llmtrain.recipes import RECIPES

def render(ids: list[int], labels: list[int], tokenizer, colour: bool) -> str:
    """Row text with the spans that carry a loss marked."""
    out = []
    for trained, group in itertools.groupby(zip(ids, labels), key=lambda t: t[1] != IGNORE):
        text = tokenizer.decode([i for i, _ in group])
        out.append((f"\x1b[32m{text}\x1b[0m" if colour else f"[[{text}]]") if trained else text)
    return "".join(out)


def _sections(config_path: str | None, overrides: list[str]) -> set[str]:
    """The top-level sections a config file and its overrides set."""
    raw = yaml.safe_load(Path(config_path).read_text()) if config_path and Path(config_path).is_file() else {}
    return set(raw if isinstance(raw, dict) else {}) | {k.split(".")[0] for k, _ in parse_overrides(overrides)}


def config_class(config_path: str | None, overrides: list[str]) -> type[Config]:
    """Config when the file sets no section of a recipe's own; else the recipe's config class that has every
    section the file sets."""
    own = _sections(config_path, overrides) - {f.name for f in dataclasses.fields(Config)}
    if not own:
        return Config
    for cls in (r.config_cls for r in RECIPES.values()):
        if own <= {f.name for f in dataclasses.fields(cls)}:
            return cls
    raise ConfigError(f"{config_path}: no recipe's config has the section(s) {', '.join(sorted(own))} "
                      f"(recipes' sections: {', '.join(sorted(_own_sections()))})")


def _own_sections() -> set[str]:
    base = {f.name for f in dataclasses.fields(Config)}
    return {f.name for r in RECIPES.values() for f in dataclasses.fields(r.config_cls)} - base


def summarize(cfg: Config, n: int) -> dict:
    processor = vision.processor_for(cfg.model, chat_template(cfg.data))  # a vision-language model's
    tokenizer = processor.tokenizer if processor else \
        load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    kind = rows_kind(cfg.data) if processor is None else vision.IMAGE_ROWS
    built = build(cfg.data, tokenizer, cfg.train.seed, processor=processor)
    rows = built.train
    sample_rows = [rows[i] for i in range(min(n, len(rows)))] if not cfg.data.streaming else \
        list(itertools.islice(rows.rows(0), n))
    scanned = rows if not cfg.data.streaming else list(itertools.islice(rows.rows(0), 1000))
    num_tokens = trained = real = 0
    for row in scanned:
        for part in kind.parts(row):
            num_tokens += len(part.ids)
            trained += sum(1 for x in part.labels if x != IGNORE)
        if kind.packs:  # the first token's label never carries a loss (nothing predicts it)
            ids, labels = list(map(int, row["input_ids"])), list(map(int, row["labels"]))
            trained -= labels[0] != IGNORE
            real += len(ids) - _pad_tail(ids, labels, list(map(int, row["position_ids"])), tokenizer.pad_token_id)
    samples = []
    for row in sample_rows:
        parts = [{"name": p.name, "input_ids": p.ids, "labels": p.labels,
                  "text": render(p.ids, p.labels, tokenizer, False)} for p in kind.parts(row)]
        sample = {"parts": parts, "text": "\n".join(f"{p['name']}: {p['text']}" if p["name"] else p["text"]
                                                    for p in parts)}
        samples.append(sample | ({"columns": kind.shown(row)} if kind.shown else {}))
    return {
        "rows_kind": kind.name,
        "samples": samples,
        "num_examples": built.stats.num_examples,
        "num_rows": len(scanned),
        "num_tokens": num_tokens,
        "trained_tokens": trained,
        "packing_efficiency": real / max(num_tokens, 1) if kind.packs else None,
        "truncated": built.stats.truncated,
        "skipped": built.stats.skipped,
        "skip_reasons": built.stats.reasons,
        "streaming": cfg.data.streaming,
        "chat_template_note": built.stats.template_note,
        "untrained": built.stats.untrained,
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
        cfg = load_config(args.config, args.overrides, config_class(args.config, args.overrides))
        check(cfg.data)
        if cfg.tokenizer.path is None:  # the tokenizer is read from model.path: say which run writes it
            try:
                check_dir("model.path", cfg.model.path)
            except ConfigError as e:
                raise ConfigError(f"{e} (the tokenizer is read from it: run what writes it first (configs/demo.yaml "
                                  "writes outputs/demo/hf), or set tokenizer.path)") from None
        check_dir("tokenizer.path", cfg.tokenizer.path)
        summary = summarize(cfg, args.n)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
        return 0
    if summary["chat_template_note"]:
        print(summary["chat_template_note"])
    colour = sys.stdout.isatty()
    tokenizer = load_tokenizer(cfg.tokenizer.path or cfg.model.path, cfg.model.trust_remote_code)
    for i, sample in enumerate(summary["samples"]):
        for part in sample["parts"]:
            trained = sum(1 for x in part["labels"] if x != IGNORE)
            name = f" {part['name']}" if part["name"] else ""
            print(f"--- row {i}{name}: {plural(len(part['input_ids']), 'token')}, {trained} trained")
            print(render(part["input_ids"], part["labels"], tokenizer, colour))
        if "columns" in sample:
            print(f"--- row {i} columns: {json.dumps(sample['columns'], ensure_ascii=False)}")
    packing = "" if summary["packing_efficiency"] is None else \
        f"; packing efficiency {summary['packing_efficiency']:.1%}"
    kind = summary["rows_kind"]  # a pair, a prompt: one example each; an unpaired row and an image chat row too
    unit = "row" if packing or kind == "tokens" or not kind.endswith("s") else kind.removesuffix("s")
    print(f"--- {plural(summary['num_examples'], 'example')} -> {plural(summary['num_rows'], unit)}"
          f"{f' of {cfg.data.seq_len} tokens' if packing else ''}; "
          f"{plural(summary['trained_tokens'], 'trained token')}{packing}; "
          f"{summary['truncated']} truncated; {summary['skipped']} skipped")
    if summary["untrained"]:
        print(f"warning: {summary['untrained']} (a run refuses to train on it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
