"""ORPO and CPO (dpo.loss=orpo | cpo), the reference-free losses of recipes/dpo.py: the losses, gradients and
TRL-named metrics against the formulas written out here (TRL 1.16's ORPOTrainer / CPOTrainer; the TRL code itself
is compared by tests/scripts/trl_dpo_parity.py, run by hand in a TRL venv); one global-batch loss whatever the
split into micro-batches; end to end, step 1 equals the formulas on the tiny model, the same losses and metrics on
1 or 2 ranks x none / ddp / fsdp2 x accumulation, the val_* metrics, no reference model built, and the settings
checked naming the key."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import REPO, TINY
from helpers.procs import losses_by_step, read_metrics, run_side_by_side
from llmtrain.config import ConfigError, DataConfig
from llmtrain.data.formats import IGNORE
from llmtrain.data.preference import collate_pairs, encode_preference
from llmtrain.losses import preference as pl
from helpers.pairs import (DPO, assert_splits_match_the_whole_batch, dpo_args, first_batch, logsig, plain_logps,
                           random_batch, sequence_logps, tiny_model)

TOL = 1e-5
# (loss, cpo_loss_type, beta, label_smoothing, gamma, cpo_alpha)
CASES = [("orpo", "sigmoid", 0.1, 0.0, 0.0, 1.0), ("orpo", "sigmoid", 0.5, 0.0, 0.0, 1.0),
         ("cpo", "sigmoid", 0.1, 0.0, 0.0, 1.0), ("cpo", "sigmoid", 0.5, 0.2, 0.0, 0.3),
         ("cpo", "hinge", 0.2, 0.0, 0.0, 1.0), ("cpo", "ipo", 0.3, 0.0, 0.0, 0.5),
         ("cpo", "simpo", 2.0, 0.1, 0.5, 1.0), ("cpo", "simpo", 2.5, 0.0, 1.2, 0.0)]


def trl_formula(loss, cpo_type, beta, eps, gamma, pc, pr, nc, nr):
    """One pair, from TRL 1.16: (loss term, chosen reward, rejected reward, logps/chosen, logps/rejected, and
    ORPO's log σ(log odds ratio) and log odds ratio). ORPOTrainer.odds_ratio_loss and CPOTrainer.cpo_loss:
    ORPO and CPO's ipo / simpo read per-token average log-probs, CPO's sigmoid / hinge summed ones."""
    if loss == "orpo" or cpo_type in ("ipo", "simpo"):
        pc, pr = pc / nc, pr / nr
    if loss == "orpo":
        log_odds = (pc - pr) - (math.log1p(-math.exp(pc)) - math.log1p(-math.exp(pr)))
        return -beta * logsig(log_odds), beta * pc, beta * pr, pc, pr, logsig(log_odds), log_odds
    z = pc - pr
    if cpo_type == "hinge":
        value = max(0.0, 1 - beta * z)
    elif cpo_type == "ipo":
        value = (z - 1 / (2 * beta)) ** 2
    else:  # sigmoid; simpo: TRL subtracts gamma / beta from z, then scales by beta
        t = beta * (z - gamma / beta) if cpo_type == "simpo" else beta * z
        value = -(1 - eps) * logsig(t) - eps * logsig(-t)
    return value, beta * pc, beta * pr, pc, pr


@pytest.mark.parametrize("loss, cpo_type, beta, eps, gamma, alpha", CASES)
def test_orpo_cpo_losses_and_metrics_equal_trl_formulas(loss, cpo_type, beta, eps, gamma, alpha):
    logits, _, labels = random_batch(seed=2)
    logits = logits / 4  # ORPO's log(1 - p) wants p = exp(average log-prob) away from 1: realistic spreads
    ids = torch.randint(0, logits.shape[-1], labels.shape, generator=torch.Generator().manual_seed(3))
    ids = torch.where(labels != IGNORE, labels, ids)  # a response's labels are its ids
    scored = pl.scored_labels(loss, {"input_ids": ids, "labels": labels})
    logps, lengths, nll_sum = pl.response_logps(pl.token_logps(logits, scored), scored, labels)
    sums = pl.preference_sums(logps, lengths, None, loss, beta, eps, gamma, cpo_type, nll_sum)
    value = pl.objective(sums, pl.pair_counts(scored), pl.nll_weight(loss, 0.0, alpha)).item()
    got = pl.metrics(sums.metrics, labels.shape[0] // 2, loss, int(pl.pair_counts(scored)[1]))

    pi, n = plain_logps(logits, labels)
    B = len(pi) // 2
    rows = [trl_formula(loss, cpo_type, beta, eps, gamma, pi[i], pi[B + i], n[i], n[B + i]) for i in range(B)]
    if loss == "orpo":  # TRL's ORPO nll_loss: cross-entropy over every chosen row's token up to its response's end
        full = labels[:B].clone()
        for row in range(B):
            end = max(t for t in range(labels.shape[1]) if labels[row, t] != IGNORE)
            full[row, :end + 1] = ids[row, :end + 1]
        full_pi, full_n = plain_logps(logits[:B], full)
        nll = -sum(full_pi) / sum(full_n)
        assert sum(full_n) > sum(n[:B])  # the prompts count
    else:  # CPO's: over every chosen response token
        nll = -sum(pi[:B]) / sum(n[:B])
    weight = 1.0 if loss == "orpo" else alpha
    assert value == pytest.approx(sum(r[0] for r in rows) / B + weight * nll, abs=1e-6)
    want = {"rewards/chosen": sum(r[1] for r in rows) / B, "rewards/rejected": sum(r[2] for r in rows) / B,
            "rewards/accuracies": sum(r[1] > r[2] for r in rows) / B,
            "rewards/margins": sum(r[1] - r[2] for r in rows) / B,
            "logps/chosen": sum(r[3] for r in rows) / B, "logps/rejected": sum(r[4] for r in rows) / B,
            "nll_loss": nll}
    if loss == "orpo":
        want |= {"log_odds_ratio": sum(r[5] for r in rows) / B, "log_odds_chosen": sum(r[6] for r in rows) / B}
    assert set(got) == set(want) == set(pl.metric_names(loss))
    for name in want:
        assert got[name] == pytest.approx(want[name], abs=1e-5, rel=1e-6), name
    assert 0 < want["rewards/accuracies"] < 1  # the batch exercises both outcomes
    if cpo_type == "hinge":
        assert 0 < sum(r[0] == 0 for r in rows) < B  # and both sides of the hinge


@pytest.mark.parametrize("loss, cpo_type, beta, eps, gamma, alpha", [CASES[1], CASES[3], CASES[4], CASES[6]])
def test_orpo_cpo_any_split_gives_the_loss_metrics_and_gradients_of_the_whole_batch(loss, cpo_type, beta, eps,
                                                                                   gamma, alpha):
    """One batch of 6 pairs, then the same pairs as micro-batches of 1, 2 and 3 pairs: the sums over
    micro-batches equal the whole batch's, the NLL term's token mean included."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    records = [json.loads(line) for line in (REPO / "data" / "demo" / "preference.jsonl").open()][:6]
    pairs = [encode_preference(r, DataConfig(seq_len=64), tok) for r in records]
    policy = tiny_model(0)

    def run(splits):
        batches = [collate_pairs(pairs[a:b], tok.pad_token_id) for a, b in splits]
        totals = sum(pl.pair_counts(pl.scored_labels(loss, b)) for b in batches)
        policy.zero_grad()
        value, summed = 0.0, torch.zeros(len(pl.metric_names(loss)))
        for batch in batches:
            inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
            scored = pl.scored_labels(loss, batch)
            logps, lengths, nll = pl.response_logps(pl.token_logps(policy(**inputs).logits, scored), scored,
                                                    batch["labels"])
            sums = pl.preference_sums(logps, lengths, None, loss, beta, eps, gamma, cpo_type, nll)
            share = pl.objective(sums, totals, pl.nll_weight(loss, 0.0, alpha))
            share.backward()
            value += share.item()
            summed += sums.metrics
        return (value, pl.metrics(summed, int(totals[0]), loss, int(totals[1])),
                [p.grad.clone() for p in policy.parameters()])

    assert_splits_match_the_whole_batch(run)


def test_orpo_cpo_settings_are_checked_naming_the_key():
    pl.check_settings("cpo", 0.1, 0.5, False, "simpo", 0.0)
    pl.check_settings("orpo", 0.0, 0.0, False)
    refused = {("orpo", 0.1, 0.0, False): "dpo.label_smoothing",
               ("cpo", 0.1, 0.0, False, "hinge"): "dpo.label_smoothing",
               ("cpo", 0.0, 0.5, False, "sigmoid"): "dpo.gamma",
               ("sigmoid", 0.0, 0.0, False, "hinge"): "dpo.cpo_loss_type",
               ("simpo", 0.0, 0.0, False, "sigmoid", 0.5): "dpo.cpo_alpha",
               ("orpo", 0.0, 0.0, False, "sigmoid", 1.0, 0.5): "dpo.sft_weight: dpo.loss=orpo",
               ("cpo", 0.0, 0.0, True): "dpo.precompute_reference: dpo.loss=cpo uses no reference model"}
    for args, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            pl.check_settings(*args)


# ----------------------------------------------------------------------------- end to end

ORPO = ("dpo.loss=orpo", "dpo.beta=0.5")
CPO = ("dpo.loss=cpo", "dpo.cpo_loss_type=simpo", "dpo.beta=2.0", "dpo.gamma=0.5", "dpo.label_smoothing=0.1",
       "dpo.cpo_alpha=0.5")
SPLITS = {  # name: (ranks, overrides): global batch 4 pairs in each
    "none": (1, ("parallel.strategy=none",)),
    "none_accum": (1, ("parallel.strategy=none", "train.micro_batch_size=2", "train.grad_accum_steps=2")),
    "ddp": (2, ("parallel.strategy=ddp", "train.micro_batch_size=1", "train.grad_accum_steps=2")),
    "fsdp2": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=2")),
}


@pytest.fixture(scope="session")
def ref_free_runs(tmp_path_factory, base, val_pairs):
    root = tmp_path_factory.mktemp("orpo_cpo")
    val = (f"data.val_path={val_pairs}", "eval.every_steps=3")
    runs = {(loss, split): (root / f"{loss}_{split}", ranks, dpo_args(base, *extra, *args, *val), DPO)
            for loss, args in (("orpo", ORPO), ("cpo", CPO)) for split, (ranks, extra) in SPLITS.items()}
    results = run_side_by_side(runs, at_once=3)
    for (loss, split), res in results.items():
        (root / f"{loss}_{split}" / "stdout.log").write_text(res.stdout)
    return {key: root / f"{key[0]}_{key[1]}" for key in runs}


@pytest.fixture(scope="session")
def val_pairs(tmp_path_factory):
    out = tmp_path_factory.mktemp("orpo_cpo_val") / "val.jsonl"
    out.write_text("".join((REPO / "data" / "demo" / "preference.jsonl").read_text().splitlines(keepends=True)[-5:]))
    return out


def expected(loss: str, model, batch, beta: float, eps: float = 0.0, gamma: float = 0.0, alpha: float = 1.0,
             cpo_type: str = "sigmoid") -> dict[str, float]:
    """TRL's formulas (trl_formula) computed in transformers on a model and batch, with TRL's metric names."""
    (pc, pr), (nc, nr) = (t.double().chunk(2) for t in sequence_logps(model, batch))
    rows = [trl_formula(loss, cpo_type, beta, eps, gamma, *map(float, r)) for r in zip(pc, pr, nc, nr)]
    B, nll = len(rows), -pc.sum().item() / nc.sum().item()
    if loss == "orpo":  # over the chosen rows' prompt tokens too: every input id up to the response's end
        labels = batch["labels"][:B]
        at = torch.arange(labels.shape[1])
        full = torch.where(at <= torch.where(labels != IGNORE, at, -1).amax(1, keepdim=True),
                           batch["input_ids"][:B], IGNORE)
        fc, fn = sequence_logps(model, {"input_ids": batch["input_ids"][:B], "position_ids": batch["position_ids"][:B],
                                        "labels": full})
        nll = -fc.double().sum().item() / fn.sum().item()
    names = pl.metric_names(loss)
    means = [sum(r[i] for r in rows) / B for i in range(len(rows[0]))]
    values = [means[1], means[2], sum(r[1] > r[2] for r in rows) / B, means[1] - means[2], means[3], means[4], nll,
              *means[5:]]
    return {"loss": means[0] + (1.0 if loss == "orpo" else alpha) * nll, **dict(zip(names, values))}


@pytest.mark.slow
def test_orpo_cpo_step_one_equals_the_formulas_and_builds_no_reference(ref_free_runs, base, val_pairs):
    """Step 1 (the base's weights) and the val_* metrics at step 3 (the export's weights) are TRL's formulas."""
    from transformers import AutoModelForCausalLM

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    settings = {"orpo": dict(beta=0.5), "cpo": dict(beta=2.0, eps=0.1, gamma=0.5, alpha=0.5, cpo_type="simpo")}
    batch, val = first_batch(), first_batch(val_pairs, pairs=5)
    for loss, kw in settings.items():
        out = ref_free_runs[loss, "none"]
        assert f"dpo: loss {loss}, beta {kw['beta']:g}, reference none" in (out / "stdout.log").read_text()
        records = read_metrics(out)
        want = expected(loss, load(base), batch, **kw)
        assert records[0]["step"] == 1
        for key, value in want.items():
            assert records[0][key] == pytest.approx(value, abs=1e-5, rel=1e-6), (loss, key)
        (logged,) = [r for r in records if "val_loss" in r]
        for key, value in expected(loss, load(out / "hf"), val, **kw).items():
            assert logged[f"val_{key}"] == pytest.approx(value, abs=1e-5, rel=1e-6), (loss, key)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["orpo", "cpo"])
def test_orpo_cpo_losses_match_across_strategies_ranks_and_accumulation(ref_free_runs, loss):
    want = losses_by_step(ref_free_runs[loss, "none"])
    assert len(want) == 3 and want[3] < want[1]
    first = read_metrics(ref_free_runs[loss, "none"])
    for split in SPLITS:
        assert losses_by_step(ref_free_runs[loss, split]) == pytest.approx(want, abs=TOL), split
        for got, ref in zip(read_metrics(ref_free_runs[loss, split]), first):
            for key in (*pl.metric_names(loss), *(f"val_{m}" for m in pl.metric_names(loss))):
                if key in ref:
                    assert got[key] == pytest.approx(ref[key], abs=TOL, rel=1e-6), (split, key)


@pytest.mark.slow
def test_orpo_cpo_bad_settings_stop_before_any_process(tmp_path, base, run_setup):
    cases = {("dpo.loss=orpo", "dpo.sft_weight=0.5"): "dpo.sft_weight: dpo.loss=orpo has its own chosen-NLL term",
             ("dpo.loss=cpo", "dpo.cpo_loss_type=dpo"): "dpo.cpo_loss_type",
             ("dpo.cpo_alpha=0.5",): "dpo.cpo_loss_type and dpo.cpo_alpha apply to dpo.loss=cpo only"}
    for i, overrides in enumerate(cases):
        code, _, err = run_setup(DPO, "--config", TINY, f"output_dir={tmp_path / f'bad{i}'}", *dpo_args(base),
                                 *overrides)
        assert code == 2 and cases[overrides] in err, (overrides, err[-2000:])
        assert "Traceback" not in err
