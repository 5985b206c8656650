"""recipes/reward.py, the Bradley–Terry reward model: the loss and TRL-named metrics against TRL 1.16's
RewardTrainer.compute_loss written out (with and without a margin and centring), gradients included, and one
global-batch loss whatever the split; end to end on the saved tiny model and data/demo/preference.jsonl, step 1
equals the formula in transformers (AutoModelForSequenceClassification on the base with the seeded head), the
same losses and metrics on 1 or 2 ranks x none / ddp / fsdp / fsdp2 x accumulation, exact resume from 2 ranks on
1, and the export loads with AutoModelForSequenceClassification and scores the held-out pairs as the trained model
did (its val_* metrics)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO, TINY
from helpers.procs import losses_by_step, read_metrics, run_recipe, run_side_by_side
from llmtrain.config import DataConfig
from llmtrain.data.formats import BadRecord
from llmtrain.data.preference import collate_pairs, encode_preference
from llmtrain.losses import reward as rl
from helpers.pairs import PAIRS, dpo_args, first_batch

REWARD = REPO / "recipes" / "reward.py"
TOL = 1e-5
SEED = 7  # tiny.yaml's train.seed: the score head's init


def trl_loss(rewards, margin=None, center=None):
    """TRL 1.16's RewardTrainer.compute_loss on logits [rows, 1], chosen rows then rejected rows."""
    rewards_chosen, rewards_rejected = torch.chunk(rewards.squeeze(-1), chunks=2)
    if margin is not None:
        loss = -F.logsigmoid(rewards_chosen - rewards_rejected - margin).mean()
    else:
        loss = -F.logsigmoid(rewards_chosen - rewards_rejected).mean()
    if center is not None:
        loss += center * torch.mean((rewards_chosen + rewards_rejected) ** 2)
    metrics = {"min_reward": rewards.min().item(), "mean_reward": rewards.mean().item(),
               "max_reward": rewards.max().item(),
               "accuracy": (rewards_chosen > rewards_rejected).float().mean().item(),
               "margin": (rewards_chosen - rewards_rejected).mean().item()}
    return loss, metrics


@pytest.mark.parametrize("with_margin, center", [(False, None), (True, None), (False, 0.01), (True, 0.3)])
def test_reward_loss_metrics_and_gradients_equal_trl(single_process_group, with_margin, center):
    g = torch.Generator().manual_seed(4)
    rewards = (torch.randn(16, 1, generator=g) * 2).requires_grad_()
    margin = torch.rand(8, generator=g) if with_margin else None
    want, want_metrics = trl_loss(rewards, margin, center)
    (want_grad,) = torch.autograd.grad(want, rewards)
    sums = rl.reward_sums(rewards[:, 0], margin, center or 0.0)
    got = sums.loss / 8
    (got_grad,) = torch.autograd.grad(got, rewards)
    assert got.item() == pytest.approx(want.item(), abs=1e-6)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-7, rtol=1e-6)
    got_metrics = rl.metrics(sums.sums, sums.extrema, 8)
    assert got_metrics == pytest.approx(want_metrics, abs=1e-6)
    assert 0 < want_metrics["accuracy"] < 1


def test_reward_any_split_gives_the_whole_batch(single_process_group):
    """Micro-batches of 1, 2 and 3 pairs (as ranks and accumulation would split them): the sums over them and
    the extrema reduced with MAX equal the whole batch's."""
    g = torch.Generator().manual_seed(5)
    rewards, margin = torch.randn(12, generator=g), torch.rand(6, generator=g)
    whole = rl.reward_sums(rewards, margin, 0.1)
    parts = [rl.reward_sums(torch.cat([rewards[a:b], rewards[6 + a:6 + b]]), margin[a:b], 0.1)
             for a, b in ((0, 1), (1, 3), (3, 6))]
    assert sum(p.loss for p in parts).item() == pytest.approx(whole.loss.item(), abs=1e-6)
    torch.testing.assert_close(sum(p.sums for p in parts), whole.sums)
    torch.testing.assert_close(torch.stack([p.extrema for p in parts]).amax(0), whole.extrema)


def test_margin_column_reaches_the_batch_and_bad_margins_are_named():
    """TRL's optional "margin" column: kept per pair into the collated batch (0 without one); a non-number is a
    bad record naming the field."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    record = {"prompt": "Anna has two cups.", "chosen": " Three.", "rejected": " Four."}
    pairs = [encode_preference(record | {"margin": 1.5}, DataConfig(seq_len=64), tok),
             encode_preference(record, DataConfig(seq_len=64), tok)]
    assert collate_pairs(pairs, tok.pad_token_id)["margin"].tolist() == [1.5, 0.0]
    for bad in ("1", None, True, float("nan")):
        with pytest.raises(BadRecord, match="field 'margin'"):
            encode_preference(record | {"margin": bad}, DataConfig(seq_len=64), tok)


# ----------------------------------------------------------------------------- end to end

SPLITS = {  # name: (ranks, overrides): global batch 4 pairs in each
    "none": (1, ("parallel.strategy=none", "checkpoint.every_steps=2")),
    "none_accum": (1, ("parallel.strategy=none", "train.micro_batch_size=2", "train.grad_accum_steps=2")),
    "ddp": (2, ("parallel.strategy=ddp", "train.micro_batch_size=1", "train.grad_accum_steps=2")),
    "fsdp": (2, ("parallel.strategy=fsdp", "train.micro_batch_size=2")),
    "fsdp2": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=2", "checkpoint.every_steps=2")),
}
CENTER = "reward.center_rewards_coefficient=0.01"
# The head trains with the adapters (PEFT's modules_to_save), on 1 process and on 2 fsdp2 ranks.
LORA = ("lora.enabled=true", "lora.r=4", "lora.alpha=8", "lora.dropout=0", "lora.modules_to_save=[score]",
        "train.lr=1e-2")
NF4 = "lora.quantize_base=nf4"  # QLoRA: the block linears in NF4 (the tiny shape's are all multiples of 64)
LORA_SPLITS = {"lora": (1, ("parallel.strategy=none", *LORA)),
               "lora_fsdp2": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=1", "train.grad_accum_steps=2",
                                  *LORA)),
               "qlora": (1, ("parallel.strategy=none", *LORA, NF4)),
               "qlora_fsdp2": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=2", *LORA, NF4))}


@pytest.fixture(scope="session")
def reward_val(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward_val") / "val.jsonl"
    out.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[-5:]))
    return out


@pytest.fixture(scope="session")
def margin_pairs(tmp_path_factory):
    """The demo pairs with TRL's margin column: 0, 0.5, 1 or 1.5."""
    out = tmp_path_factory.mktemp("reward_margin") / "pairs.jsonl"
    lines = PAIRS.read_text().splitlines()[:40]
    out.write_text("".join(json.dumps(json.loads(line) | {"margin": (i % 4) / 2}) + "\n"
                           for i, line in enumerate(lines)))
    return out


@pytest.fixture(scope="session")
def reward_runs(tmp_path_factory, base, reward_val, margin_pairs):
    root = tmp_path_factory.mktemp("reward")
    val = (f"data.val_path={reward_val}", "eval.every_steps=3")
    margin = {"margin": (1, ("parallel.strategy=none", "train.max_steps=1", f"data.path={margin_pairs}"))}
    runs = {name: (root / name, ranks, dpo_args(base, *extra, *val, CENTER), REWARD)
            for name, (ranks, extra) in (SPLITS | LORA_SPLITS | margin).items()}
    for name, res in run_side_by_side(runs, at_once=3).items():
        (root / name / "stdout.log").write_text(res.stdout)
    return {name: root / name for name in runs}


def with_head(base):
    """The base's body under transformers' sequence classifier, its score head initialized as the recipe does."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, pad_token_id=2,
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        model.score.weight.normal_(0.0, model.config.initializer_range, generator=torch.Generator().manual_seed(SEED))
    return model


def scores(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"]).logits.float()


@pytest.mark.slow
def test_reward_step_one_equals_trl_formula_on_the_seeded_head(reward_runs, base):
    batch = first_batch()
    want, want_metrics = trl_loss(scores(with_head(base), batch), center=0.01)
    got = read_metrics(reward_runs["none"])[0]
    assert got["step"] == 1 and got["loss"] == pytest.approx(want.item(), abs=1e-6)
    for key, value in want_metrics.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.slow
def test_reward_margin_column_enters_the_loss(reward_runs, base, margin_pairs):
    batch = first_batch(margin_pairs)
    assert batch["margin"].sum() > 0
    want, _ = trl_loss(scores(with_head(base), batch), margin=batch["margin"], center=0.01)
    unmargined, _ = trl_loss(scores(with_head(base), batch), center=0.01)
    got = read_metrics(reward_runs["margin"])[0]
    assert got["loss"] == pytest.approx(want.item(), abs=1e-6) and abs(want.item() - unmargined.item()) > 1e-3


@pytest.mark.slow
def test_reward_losses_match_across_strategies_ranks_and_accumulation(reward_runs):
    want = losses_by_step(reward_runs["none"])
    assert len(want) == 3 and want[3] < want[1]
    first = read_metrics(reward_runs["none"])
    keys = (*rl.METRICS, "val_loss", *(f"val_{m}" for m in rl.METRICS))
    for name in SPLITS:
        assert losses_by_step(reward_runs[name]) == pytest.approx(want, abs=TOL), name
        for got, ref in zip(read_metrics(reward_runs[name]), first):
            for key in keys:
                if key in ref:
                    assert got[key] == pytest.approx(ref[key], abs=TOL), (name, key)


@pytest.mark.slow
def test_reward_export_scores_are_the_trained_models(reward_runs, reward_val):
    """hf/ loads with AutoModelForSequenceClassification; its scores of the 5 held-out pairs give the val_*
    metrics the trained model logged at the last step (every reward's min, max and mean, the accuracy)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_runs["none"] / "hf", dtype=torch.float32)
    assert model.config.num_labels == 1 and model.config.architectures == ["LlamaForSequenceClassification"]
    loss, want = trl_loss(scores(model.eval(), first_batch(reward_val, pairs=5)), center=0.01)
    (logged,) = [r for r in read_metrics(reward_runs["none"]) if "val_loss" in r]
    assert logged["step"] == 3 and logged["val_loss"] == pytest.approx(loss.item(), abs=1e-5)
    for key, value in want.items():
        assert logged[f"val_{key}"] == pytest.approx(value, abs=1e-5), key


@pytest.mark.slow
def test_reward_lora_trains_the_head_with_the_adapters_and_exports_it(reward_runs, reward_val, base):
    """LoRA with score in lora.modules_to_save: the same losses on 2 fsdp2 ranks as on 1 process; the adapter
    holds the head's trained copy; the merged export (hf/) scores the held-out pairs as the trained model did."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    want = losses_by_step(reward_runs["lora"])
    assert len(want) == 3 and want[3] < want[1]
    assert losses_by_step(reward_runs["lora_fsdp2"]) == pytest.approx(want, abs=TOL)
    adapter = load_file(reward_runs["lora"] / "adapter" / "adapter_model.safetensors")
    (head,) = [k for k in adapter if k.startswith("base_model.model.score.")]
    model = AutoModelForSequenceClassification.from_pretrained(reward_runs["lora"] / "hf", dtype=torch.float32)
    torch.testing.assert_close(model.score.weight, adapter[head])
    assert not torch.equal(model.score.weight, with_head(base).score.weight)  # trained from its seeded start
    loss, want_metrics = trl_loss(scores(model.eval(), first_batch(reward_val, pairs=5)), center=0.01)
    (logged,) = [r for r in read_metrics(reward_runs["lora"]) if "val_loss" in r]
    assert logged["val_loss"] == pytest.approx(loss.item(), abs=1e-5)
    for key, value in want_metrics.items():
        assert logged[f"val_{key}"] == pytest.approx(value, abs=1e-5), key


@pytest.mark.slow
def test_reward_qlora_trains_on_an_nf4_base_the_same_on_one_or_two_ranks(reward_runs):
    """lora.quantize_base=nf4: the block linears quantized (the score head, outside the blocks, trains in full
    precision with the adapters); the same losses on 2 fsdp2 ranks as on 1 process, other than LoRA's."""
    want = losses_by_step(reward_runs["qlora"])
    assert len(want) == 3 and want[3] < want[1]
    assert losses_by_step(reward_runs["qlora_fsdp2"]) == pytest.approx(want, abs=TOL)
    assert want != pytest.approx(losses_by_step(reward_runs["lora"]), abs=1e-6)  # the NF4 base differs
    assert "nf4" in (reward_runs["qlora"] / "stdout.log").read_text().lower()


@pytest.mark.slow
def test_reward_resumes_exactly_from_two_ranks_on_one(tmp_path, reward_runs, base):
    """fsdp2 on 2 ranks at step 2 -> one process: step 3 as the uninterrupted run's."""
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(reward_runs["fsdp2"] / "checkpoints" / "step_2", out / "checkpoints" / "step_2")
    res = run_recipe(out, *dpo_args(base, "parallel.strategy=none", CENTER), script=REWARD)
    assert "resumed at step 2" in res.stdout
    assert losses_by_step(out)[3] == pytest.approx(losses_by_step(reward_runs["none"])[3], abs=TOL)


@pytest.mark.slow
def test_reward_bad_settings_name_the_key(tmp_path, base, run_setup):
    cases = {("data.format=text",): "data.format=preference",
             ("lora.enabled=true",): "lora.modules_to_save",
             ("train.loss_impl=full",): "train.loss_impl=full: recipes/reward.py reads one score per row",
             ("model.path=outputs/nowhere/hf",): "recipes/finetune.py --config configs/demo.yaml",
             ("reward.center_rewards_coefficient=-1",): "reward.center_rewards_coefficient"}
    for i, overrides in enumerate(cases):
        args = [a for a in dpo_args(base) if not a.startswith(tuple(o.split("=")[0] + "=" for o in overrides))]
        code, _, err = run_setup(REWARD, "--config", TINY, f"output_dir={tmp_path / f'bad{i}'}", *args, *overrides)
        assert code == 2 and cases[overrides] in err, (overrides, err[-2000:])
        assert "Traceback" not in err


def test_reward_demo_table_is_the_committed_run():
    """docs/preference.md's reward-demo table is the eval records of docs/measured/demo-reward.jsonl (the metrics.jsonl
    of the page's command, after the SFT demo), and its last held-out accuracy is the issue's >= 0.9. When a change
    moves them, run the command again, copy its metrics.jsonl over the measured file and update the table."""
    records = [json.loads(line) for line in (REPO / "docs" / "measured" / "demo-reward.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if "val_loss" in r}
    lines = (REPO / "docs" / "preference.md").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| held-out `val_accuracy` |"))
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")][1:]  # noqa: E731
    steps = [int(s) for s in cells(lines[at - 2])]
    assert steps == sorted(evals), steps
    assert cells(lines[at]) == [f"{evals[s]['val_accuracy']:.3f}" for s in steps]
    assert cells(lines[at + 1]) == [f"{evals[s]['val_margin']:.2f}" for s in steps]
    assert evals[steps[-1]]["val_accuracy"] >= 0.9
