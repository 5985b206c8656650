"""The rollout: section (llmtrain.rollout.section) both on-policy recipes carry: recipes/grpo.py and
recipes/distill.py list its keys in --help-config; the engine keys' old names (grpo.engine, grpo.vllm_*) stop
recipes/grpo.py in one line naming the new key, exit 2, before any process group; distillation refuses an engine
it would never use (distill.on_policy_fraction 0) and checks the engine as GRPO does."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import REPO, TINY
from helpers.grpo import GRPO, write_config
from llmtrain.config import MOVED
from llmtrain.rollout.section import RolloutSection

DISTILL = REPO / "recipes" / "distill.py"
KEYS = [f"rollout.{f.name}" for f in dataclasses.fields(RolloutSection)]
OLD = {"grpo.engine": "transformers", "grpo.vllm_gpu_memory_utilization": 0.5, "grpo.vllm_enable_sleep_mode": True,
       "grpo.vllm_server_url": "http://host:8000", "grpo.vllm_server_timeout": 10, "grpo.vllm_group_port": 5000}


def test_both_recipes_list_the_rollout_keys(run_setup):
    assert len(KEYS) == 6
    for script in (GRPO, DISTILL):
        code, out, _ = run_setup(script, "--help-config")
        listed = [line.split()[0] for line in out.splitlines() if line.startswith("rollout.")]
        assert code == 0 and listed == KEYS, (script, listed)


def test_the_old_engine_keys_name_the_new_one(run_setup, tmp_path):
    config = write_config(tmp_path)
    assert sorted(MOVED) == sorted(OLD) and all(MOVED[k] == k.replace("grpo.", "rollout.") for k in OLD)
    for key, value in OLD.items():
        code, _, err = run_setup(GRPO, "--config", config, f"{key}={value}", world_size=2)
        assert (code, err.strip()) == (2, f"error: {key} moved to {MOVED[key]}"), key


def test_distillation_refuses_an_engine_it_would_not_use_and_checks_the_one_it_uses(run_setup):
    code, _, err = run_setup(DISTILL, "--config", TINY, "rollout.engine=transformers")
    assert code == 2 and err.strip() == ("error: rollout: its engine samples on-policy steps only; set "
                                         "distill.on_policy_fraction > 0, or leave rollout.* unset")
    code, _, err = run_setup(DISTILL, "--config", TINY, "data.format=instruction", "data.packing=false",
                             "distill.on_policy_fraction=1", "rollout.engine=vllm", "distributed.device=cpu")
    assert code == 2 and err.strip().startswith("error: rollout.engine: vllm runs on CUDA GPUs only"), err
    assert "\n" not in err.strip()


@pytest.mark.parametrize("key", ["rollout.engine", "rollout.vllm_server_url"])
def test_grpo_checks_the_section_at_set_up(run_setup, tmp_path, key):
    """The engine's set-up checks read the rollout: section (each one line, exit 2)."""
    config = write_config(tmp_path)
    value = {"rollout.engine": "vllm", "rollout.vllm_server_url": "http://host:8000"}[key]
    code, _, err = run_setup(GRPO, "--config", config, f"{key}={value}", "distributed.device=cpu")
    assert code == 2 and err.strip().startswith(f"error: {key}") and "\n" not in err.strip(), err
