"""The recipe's --help and --help-config explain its use, and every recipe config under configs/ (configs/accelerate/
is tests/run/test_launch.py's) loads with its recipe's config class and has a header saying hardware, memory and
how to launch it."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import RECIPE, REPO
from helpers.procs import finish, start
from llmtrain.config import load_config
from llmtrain.data.__main__ import config_class


NOT_LLMTRAIN_CONFIG_DIRS = {"accelerate"}  # configs/accelerate/: accelerate's own launcher files


@pytest.mark.slow
def test_help_explains_usage():
    helps = [finish(proc, timeout=120) for proc in [start([RECIPE, flag]) for flag in ("--help", "--help-config")]]
    assert [res.returncode for res in helps] == [0, 0]
    text, config = (res.stdout for res in helps)
    for words in ("torchrun --nproc_per_node=N recipes/finetune.py --config", "--help-config", "--print-config",
                  "metrics.jsonl", "python -m llmtrain.plot", "python -m llmtrain.tools.generate",
                  "python -m llmtrain.convert"):
        assert words in text, words
    lines = config.splitlines()
    assert any(line.startswith("log.wandb.project ") and "None" in line for line in lines)


def _config_files() -> list[Path]:
    return sorted(p for p in (REPO / "configs").rglob("*")
                  if p.suffix in (".yaml", ".yml")
                  and not NOT_LLMTRAIN_CONFIG_DIRS & set(p.relative_to(REPO / "configs").parts))


def test_configs_cover_the_use_cases():
    names = {p.name for p in _config_files()}
    assert {"demo.yaml", "smollm2-360m-ddp.yaml", "llama3.2-1b-fsdp2.yaml", "llama3.2-3b-fsdp2.yaml",
            "llama3.1-8b-multinode.yaml", "chat-sft-llama3.1-8b.yaml", "cpt-llama3.2-1b-text.yaml"} <= names


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_config_file_is_valid_and_documented(path):
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    text = "\n".join(header)
    # types, choices, cross-field checks (with the Config of the recipe the header launches); no weights or data read
    cfg = load_config(path, cls=config_class(str(path), []))  # the recipe's config by its own section (dpo:)
    assert len(header) >= 3 and "Hardware:" in text and "Memory:" in text, f"{path.name}: comment header"
    assert f"configs/{path.relative_to(REPO / 'configs')}" in text, f"{path.name}: the header shows how to launch it"
    assert Path(cfg.output_dir).parts[0] == "outputs"
