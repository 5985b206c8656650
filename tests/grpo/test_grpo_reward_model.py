"""A reward-model directory as a grpo.reward_funcs entry (TRL's GRPOTrainer takes a model there): the rewards it
gives in a run equal scoring the logged prompt + completion with AutoModelForSequenceClassification and the reward
model's own tokenizer directly, one text at a time, as TRL writes them (text concatenated; messages through the
reward model's chat template, which differs from the policy's here), on one process beside a reward function with
weights, on 2 fsdp2 ranks with the reward model sharded and on 2 ddp ranks with it whole on each; logged under its
directory's name; a causal LM directory and a reward model inside output_dir exit 2 in one line before any process
group."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          LlamaForSequenceClassification)

from helpers import REPO
from helpers.grpo import GRPO, write_config
from helpers.procs import finish_recipe, read_metrics, start_recipe
from llmtrain import rewards
from llmtrain.config import ConfigError

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
# Not the policy's template (assets/tokenizer's Llama 3 headers): the reward model must write with its own.
TEMPLATE = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}{{ eos_token }}"
WEIGHT = 0.5


def save_model(path, cls, template: str | None = None) -> None:
    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    if template is not None:
        tokenizer.chat_template = template
    torch.manual_seed(3)
    config = LlamaConfig(**TINY, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, num_labels=1,
                         initializer_range=0.2)
    cls(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo_rm")
    save_model(tmp / "judge", LlamaForSequenceClassification, TEMPLATE)
    save_model(tmp / "causal", LlamaForCausalLM)
    with open(tmp / "chat.jsonl", "w") as f:
        for line in (REPO / "data" / "demo" / "prompts.jsonl").read_text().splitlines():
            record = json.loads(line)
            f.write(json.dumps({**record, "prompt": [{"role": "user", "content": record["prompt"]}]}) + "\n")
    return tmp, write_config(tmp)


# The 2-rank runs on chat prompts, by the policy's strategy: how the reward model is held beside it (train.frozen's
# log line): sharded on fsdp2's mesh, whole on each ddp rank.
HELD = {"chat": ("fsdp2", "fsdp2"), "ddp": ("ddp", "none")}


@pytest.fixture(scope="module")
def runs(dirs):
    tmp, config = dirs
    judge, chars = tmp / "judge", f"{tmp / 'rewards.py'}:chars"
    once = ("train.max_steps=1", "grpo.beta=0.0", "grpo.num_iterations=1")
    started = {"text": start_recipe(tmp / "text", f"grpo.reward_funcs=[{chars},{judge}]",
                                    f"grpo.reward_weights=[1.0,{WEIGHT}]", *once, config=config, script=GRPO)}
    for run, (strategy, _) in HELD.items():
        started[run] = start_recipe(tmp / run, f"grpo.reward_funcs=[{judge}]", f"data.path={tmp / 'chat.jsonl'}",
                                    f"parallel.strategy={strategy}", "train.micro_batch_size=3", *once, nproc=2,
                                    config=config, script=GRPO)
    return {run: finish_recipe(proc) for run, proc in started.items()}


def direct_scores(path, records: list[dict], tokenizer_path=None) -> list[float]:
    """TRL's scoring of each record's prompt + completion, one at a time (no padding), with the model at `path`
    and the tokenizer at tokenizer_path (the model's own by default)."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or path)
    out = []
    for r in records:
        prompt = r["prompt"]
        text = (tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": r["completion"]}],
                                              tokenize=False) if isinstance(prompt, list) else prompt + r["completion"])
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out.append(model(input_ids=ids).logits[0, 0].item())
    return out


def completions(out) -> list[dict]:
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["text", *HELD])
def test_reward_model_rewards_equal_scoring_with_auto_model_for_sequence_classification(dirs, runs, run):
    tmp, _ = dirs
    logged = completions(tmp / run)
    assert len(logged) == 12  # every completion of the step
    assert direct_scores(tmp / "judge", logged) == pytest.approx([r["rewards"]["judge"] for r in logged], abs=1e-5)
    assert len({round(r["rewards"]["judge"], 4) for r in logged}) > len(logged) // 2  # they differ: a real test
    if run in HELD:  # the policy's chat template would give other rewards
        policy = direct_scores(tmp / "judge", logged, REPO / "assets" / "tokenizer")
        assert all(abs(a - r["rewards"]["judge"]) > 1e-4 for a, r in zip(policy, logged))
        assert "grpo: reward model " + str(tmp / "judge") + " (" in runs[run].stdout
        assert f"frozen, {HELD[run][1]}," in runs[run].stdout


@pytest.mark.slow
def test_reward_model_is_weighted_and_logged_under_its_name_like_the_functions(dirs, runs):
    tmp, _ = dirs
    logged = completions(tmp / "text")
    for r in logged:
        assert r["rewards"]["chars"] == pytest.approx(len(r["completion"].strip()) / 10, abs=1e-12)
        assert r["reward"] == pytest.approx(r["rewards"]["chars"] + WEIGHT * r["rewards"]["judge"], abs=1e-5)
    judge = [r["rewards"]["judge"] for r in logged]
    (record,) = [m for m in read_metrics(tmp / "text") if "loss" in m]
    assert record["rewards/judge/mean"] == pytest.approx(sum(judge) / len(judge), abs=1e-5)
    assert record["reward"] == pytest.approx(sum(r["reward"] for r in logged) / len(logged), abs=1e-5)


def test_a_reward_model_entry_is_named_by_its_directory_and_is_an_input_path(dirs):
    tmp, _ = dirs
    (func,) = rewards.load_all([str(tmp / "judge")])
    assert func.name == "judge" and func.fn is None
    assert rewards.file_of(str(tmp / "judge")) == str(tmp / "judge")
    with pytest.raises(ConfigError, match=r"grpo.reward_funcs\[0\]: 'nowhere/rm' is not 'package.module:function', "
                                          r"'path/to/file.py:function' or a reward-model directory"):
        rewards.load_all(["nowhere/rm"])


def test_a_causal_lm_directory_exits_2_in_one_line_before_start(dirs, run_setup):
    tmp, config = dirs
    out = tmp / "refused"
    code, _, err = run_setup(GRPO, "--config", config, f"output_dir={out}", f"grpo.reward_funcs=[{tmp / 'causal'}]")
    assert code == 2 and err.strip().count("\n") == 0, err
    assert (f"grpo.reward_funcs[0]: {tmp / 'causal'} is a LlamaForCausalLM (config.json), a causal LM with no score "
            "head; a reward model is a sequence classifier") in err
    assert not out.exists()


def test_a_reward_model_inside_output_dir_exits_2_before_start(dirs, run_setup):
    tmp, config = dirs
    code, _, err = run_setup(GRPO, "--config", config, f"output_dir={tmp}", f"grpo.reward_funcs=[{tmp / 'judge'}]")
    assert code == 2 and f"output_dir={tmp} holds grpo.reward_funcs[0]={tmp / 'judge'}" in err, err
