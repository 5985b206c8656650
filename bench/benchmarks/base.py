"""What the benchmarks of bench/run.py share: the shapes, the context (quick, working directory, TRL's venv,
pairs), a ratio against its target, a markdown table."""

from __future__ import annotations

from pathlib import Path

import yaml

from common import REPO


BENCH = REPO / "bench"
BASELINES = BENCH / "baselines"  # what the recipes are compared with: the bare loop, HF Trainer, TRL
DEMO = REPO / "configs" / "demo.yaml"
SHAPE_32K = BENCH / "configs" / "llama-32k.yaml"  # real proportions (Llama 2 / Mistral), scaled down
SHAPE_128K = BENCH / "configs" / "llama-128k.yaml"  # Llama 3's vocabulary, seq 2048
TIMEOUT = 600


def ratio(name: str, value: float | None, target: float | None = None, op: str = ">=", note: str = "") -> dict:
    met = None
    if target is not None and value is not None:
        met = value >= target if op == ">=" else value <= target
    return {"name": name, "value": value, "target": target, "op": op, "met": met, "note": note}


def table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def describe_shape(cfg: Path) -> str:
    c = yaml.safe_load(cfg.read_text())
    m = c["model"]["config"]
    return (f"{cfg.relative_to(REPO)}: vocab {m['vocab_size']:,}, hidden {m['hidden_size']}, {m['num_hidden_layers']} "
            f"layers, {m['num_attention_heads']} heads / {m['num_key_value_heads']} KV, "
            f"{'tied' if m['tie_word_embeddings'] else 'untied'} embeddings, seq {c['data']['seq_len']}, "
            f"micro-batch {c['train']['micro_batch_size']}")


def write_config(path: Path, base: Path, changes: dict) -> Path:
    """A copy of a YAML config with nested changes {"data": {"path": ...}} applied."""
    cfg = yaml.safe_load(base.read_text())
    for section, values in changes.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class Ctx:
    def __init__(self, quick: bool, work: Path, trl_venv: Path, pairs: int):
        self.quick, self.work, self.trl_venv, self.pairs = quick, work, trl_venv, pairs
        # what the tables say: no machine's path in the results
        self.trl_venv_shown = trl_venv.relative_to(REPO) if trl_venv.is_relative_to(REPO) else trl_venv.name

    def dir(self, name: str) -> Path:
        path = self.work / name
        path.mkdir(parents=True, exist_ok=True)
        return path


MEM_SHAPE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12,
             "num_key_value_heads": 12, "vocab_size": 32000, "tie_word_embeddings": True,
             "max_position_embeddings": 2048}
MEM_SHAPE_QUICK = {**MEM_SHAPE, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 4}
