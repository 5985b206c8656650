"""What the tests share besides fixtures (those live in tests/conftest.py): process launches (procs), the
export check (export), the tiny model families (families), the engine tests' stale-copy check (engines) and the
vLLM engines' fakes (vllm), among others. Test modules import these, never each other."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "finetune.py"
TINY = REPO / "tests" / "tiny.yaml"


def recipe_configs() -> list[type]:
    """Every recipe's config class (llmtrain.recipes.RECIPES), the shared Config first."""
    from llmtrain.recipes import RECIPES

    return list(dict.fromkeys(r.config_cls for r in RECIPES.values()))
