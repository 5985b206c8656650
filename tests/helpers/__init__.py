"""What the tests share besides fixtures (those live in tests/conftest.py): process launches (procs), the
export check (export) and the tiny model families (families). Test modules import these, never each other."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "finetune.py"
TINY = REPO / "tests" / "tiny.yaml"


def recipe_configs() -> list[type]:
    """Every recipe's config class: Config and its subclasses, which live with their losses in llmtrain.losses
    (dpo.* in preference.py, grpo.* in policy.py) or in llmtrain.distill (distill.*), so no test needs to load
    a recipe as a module."""
    import importlib
    import pkgutil

    from llmtrain import losses
    from llmtrain.config import Config

    for module in pkgutil.iter_modules(losses.__path__):
        importlib.import_module(f"llmtrain.losses.{module.name}")
    importlib.import_module("llmtrain.distill")
    return [Config, *Config.__subclasses__()]
