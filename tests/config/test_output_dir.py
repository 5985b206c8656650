"""An output_dir that would spread a run over what a user keeps: empty, the current, root
or home directory, or one that is, lies inside or holds one of the run's inputs (each section declares its own:
config.input_path) is refused in one line at set-up, before anything is written (run_setup: in process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import REPO, RECIPE, TINY
from llmtrain.config import input_paths, load_config
from llmtrain.recipes.distill import DistillConfig
from llmtrain.recipes.grpo import GRPOConfig
from llmtrain.train.cli import check_apart

TOKENIZER = REPO / "assets" / "tokenizer"
DATA = REPO / "data" / "demo" / "val.jsonl"
# Absolute inputs, so that a run started from another directory finds them (before the fix, it ran there).
ABSOLUTE = [f"tokenizer.path={TOKENIZER}", f"data.path={DATA}"]


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refused(run_setup, script: Path, *args: str, config: Path = TINY) -> str:
    code, out, err = run_setup(script, "--config", config, *args)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("output_dir,words", [
    ("", "output_dir is empty (an unset variable in output_dir=$VAR?)"),
    ("   ", "output_dir is empty"),
    (".", "is the current directory"),
    ("CWD", "is the current directory"),
    ("/", "is the filesystem root"),
    ("HOME", "is the home directory"),
    ("../cwd/", "is the current directory"),
])
def test_an_output_dir_over_the_users_own_places_writes_nothing(tmp_path, monkeypatch, run_setup, output_dir, words):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir(), home.mkdir()
    (cwd / "config.yaml").write_text("mine\n")
    (cwd / "hf").mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    output_dir = {"CWD": str(cwd), "HOME": str(home)}.get(output_dir, output_dir)
    err = refused(run_setup, RECIPE, *ABSOLUTE, f"output_dir={output_dir}", "train.max_steps=1")
    assert words in err, err
    assert files(cwd) == ["config.yaml", "hf"] and files(home) == [] and (cwd / "config.yaml").read_text() == "mine\n"


def test_distillation_into_the_teachers_parent_is_refused_naming_both(tmp_path, run_setup):
    """Teacher X/hf, output_dir=X would export the student over the teacher."""
    teacher = tmp_path / "X" / "hf"
    teacher.mkdir(parents=True)
    (teacher / "config.json").write_text("{}")
    err = refused(run_setup, REPO / "recipes" / "distill.py", f"output_dir={tmp_path / 'X'}",
                  f"distill.teacher_path={teacher}", config=REPO / "configs" / "demo-distill.yaml")
    assert f"output_dir={tmp_path / 'X'} holds distill.teacher_path={teacher}: " in err, err
    assert files(tmp_path) == ["X", "X/hf", "X/hf/config.json"]


@pytest.mark.parametrize("where", ["model.path", "tokenizer.path", "data.path", "data glob", "data dir",
                                   "data.val_path", "data.chat_template", "lora.init_from"])
def test_an_output_dir_that_is_inside_or_holds_an_input_is_refused(tmp_path, run_setup, where):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "a.jsonl").write_text(DATA.read_text())
    (inputs / "t.jinja").write_text("{{ messages }}")
    args, output_dir, named = {
        "model.path": (["model.config=null", f"model.path={inputs}"], inputs, f"is model.path={inputs}"),
        "tokenizer.path": ([f"tokenizer.path={inputs}"], inputs / "run", f"lies inside tokenizer.path={inputs}"),
        "data.path": ([f"data.path={inputs / 'a.jsonl'}"], inputs, f"holds data.path={inputs / 'a.jsonl'}"),
        "data glob": ([f"data.path={inputs}/*.jsonl"], inputs, f"holds data.path={inputs / 'a.jsonl'}"),
        "data dir": ([f"data.path={inputs}"], inputs / "out", f"lies inside data.path={inputs}"),
        "data.val_path": ([f"data.val_path={inputs / 'a.jsonl'}"], tmp_path, "holds data.val_path="),
        "data.chat_template": ([f"data.chat_template={inputs / 't.jinja'}"], inputs, "holds data.chat_template="),
        "lora.init_from": (["lora.enabled=true", f"lora.init_from={inputs}"], inputs, "is lora.init_from="),
    }[where]
    before = files(tmp_path)
    err = refused(run_setup, RECIPE, f"output_dir={output_dir}", *args)
    assert f"output_dir={output_dir} {named}" in err, err
    assert files(tmp_path) == before


def test_grpo_reward_files_and_distillation_stores_are_inputs(tmp_path, run_setup):
    rewards = tmp_path / "rewards"
    rewards.mkdir()
    (rewards / "mine.py").write_text("def score(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    err = refused(run_setup, REPO / "recipes" / "grpo.py", f"output_dir={rewards}",
                  f"grpo.reward_funcs=[{rewards / 'mine.py'}:score]", config=REPO / "configs" / "demo-grpo.yaml")
    assert f"output_dir={rewards} holds grpo.reward_funcs[0]={rewards / 'mine.py'}" in err, err
    store = tmp_path / "store"
    store.mkdir()
    err = refused(run_setup, REPO / "recipes" / "distill.py", f"output_dir={store / 'run'}",
                  f"distill.teacher_logits={store}", "distill.teacher_path=null",
                  config=REPO / "configs" / "demo-distill.yaml")
    assert f"output_dir={store / 'run'} lies inside distill.teacher_logits={store}" in err, err
    assert files(store) == []


def test_every_recipes_inputs_are_declared_and_apart_ones_pass(tmp_path):
    """What each section declares (the shared check reads nothing else); an output_dir beside the inputs, a Hub
    id and a module reward pass."""
    cfg = load_config(REPO / "configs" / "demo-grpo.yaml", ["grpo.reward_funcs=[llmtrain.rewards:format_regex, "
                                                            "r/x.py:f]"], GRPOConfig)
    assert input_paths(cfg) == {"model.path": "outputs/demo/hf", "data.path": "data/demo/prompts.jsonl",
                                "grpo.reward_funcs[1]": "r/x.py"}
    cfg = load_config(REPO / "configs" / "demo-distill.yaml", ["distill.teacher_logits=store"], DistillConfig)
    assert input_paths(cfg)["distill.teacher_path"] == "outputs/demo/hf"
    assert input_paths(cfg)["distill.teacher_logits"] == "store"
    (tmp_path / "in").mkdir()
    check_apart(str(tmp_path / "out"), {"model.path": str(tmp_path / "in"), "data.path": "org/name",
                                        "tokenizer.path": str(tmp_path / "input")})
