"""KTO (recipes/kto.py, llmtrain/losses/kto.py, data.format=unpaired): the loss, its gradients, the KL point and
TRL-named metrics against the formulas written out here (TRL 1.16's KTOTrainer; the TRL code itself is compared by
tests/scripts/trl_kto_parity.py, run by hand in a TRL venv); the unpaired records and their KL rows (TRL's rotation);
one global-batch loss and KL point whatever the split into micro-batches; end to end, the same losses and metrics on
1 or 2 ranks x none / ddp / fsdp2 x accumulation, the precomputed reference equal to the live one, LoRA's
adapters-off reference, an exact resume from 2 ranks onto 1, the validation pass (the formulas over the held-out
rows, the same at any split), and bad input stopped in one line."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch

from helpers import REPO, TINY
from helpers.pairs import assert_splits_match_the_whole_batch, tiny_model
from helpers.procs import losses_by_step, read_metrics, run_recipe, run_side_by_side
from llmtrain import data
from llmtrain.config import ConfigError, DataConfig
from llmtrain.data.records import IGNORE, BadRecord
from llmtrain.data.unpaired import KL_COMPLETION, collate_unpaired, encode_unpaired, with_kl_completions
from llmtrain.losses import kto as kl_lib
from llmtrain.losses.preference import sequence_logps
from llmtrain.losses.token import token_logps
from llmtrain.models.hf import load_tokenizer

KTO = REPO / "recipes" / "kto.py"
ROWS = REPO / "data" / "demo" / "unpaired.jsonl"
TOL = 1e-5
REL = 1e-6  # logps/* are sums of about -60 over a completion's tokens, where fp32 steps by 4e-6
METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(REPO / "assets" / "tokenizer"), False)


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def trl_formula(loss_type: str, beta: float, wd: float, wu: float, logp: float, ref: float, good: bool, z0: float):
    """One row, from TRL 1.16's KTOTrainer._compute_loss: (loss, d loss / d logp, reward)."""
    delta = logp - ref
    if loss_type == "kto":
        s = sig(beta * (delta - z0)) if good else sig(beta * (z0 - delta))
        value, slope = 1 - s, (-1 if good else 1) * beta * s * (1 - s)
    elif good:  # apo_zero_unpaired
        s = sig(beta * delta)
        value, slope = 1 - s, -beta * s * (1 - s)
    else:
        s = sig(beta * delta)
        value, slope = s, beta * s * (1 - s)
    weight = wd if good else wu
    return weight * value, weight * slope, beta * delta


@pytest.mark.parametrize("loss_type, beta, wd, wu, shift", [("kto", 0.1, 1.0, 1.0, 0.3), ("kto", 0.5, 1.33, 0.75, 0.3),
                                                            ("kto", 0.2, 1.0, 1.0, -0.3),
                                                            ("apo_zero_unpaired", 0.2, 1.0, 2.0, 0.3)])
def test_kto_loss_gradients_kl_point_and_metrics_equal_trl_formulas(loss_type, beta, wd, wu, shift):
    """Random summed log-probs of 10 rows (4 desirable) and their KL rows: the loss, its gradient by each row's
    log-prob, z0 = max(0, mean KL-row log-ratio) (above and at its clamp: shift) and the metrics, as TRL computes
    them row by row."""
    g = torch.Generator().manual_seed(1)
    logps = (torch.randn(10, generator=g, dtype=torch.float64) * 3 - 60).requires_grad_()
    ref = logps.detach() + torch.randn(10, generator=g, dtype=torch.float64)
    kl_policy, kl_ref = torch.randn(10, generator=g) * 2 - 70, torch.randn(10, generator=g) * 2 - 70
    kl_ref = kl_ref - (kl_ref - kl_policy).mean() - shift  # the mean KL-row log-ratio is `shift`
    good = torch.tensor([True, False, False, True, False, True, False, False, True, False])

    z0 = kl_lib.kl_point(kl_lib.kl_sums(kl_policy, kl_ref), torch.tensor(10))
    sums = kl_lib.kto_sums(logps, ref, good, z0, beta, wd, wu, loss_type)
    loss = kl_lib.objective(sums, torch.tensor(10.0))
    loss.backward()
    got = kl_lib.metrics(sums.metrics, 4, 6, z0.item())

    want_z0 = max(0.0, sum(float(a - b) for a, b in zip(kl_policy, kl_ref)) / 10)
    assert z0.item() == pytest.approx(want_z0, abs=1e-6) and (want_z0 > 0) == (shift > 0)
    rows = [trl_formula(loss_type, beta, wd, wu, float(p), float(r), bool(k), want_z0)
            for p, r, k in zip(logps.detach(), ref, good)]
    assert loss.item() == pytest.approx(sum(r[0] for r in rows) / 10, abs=1e-6)
    torch.testing.assert_close(logps.grad, torch.tensor([r[1] / 10 for r in rows], dtype=torch.float64),
                               atol=1e-8, rtol=1e-5)
    chosen = [i for i in range(10) if good[i]]
    rejected = [i for i in range(10) if not good[i]]
    want = {"kl": want_z0, "rewards/chosen": sum(rows[i][2] for i in chosen) / 4,
            "rewards/rejected": sum(rows[i][2] for i in rejected) / 6,
            "logps/chosen": sum(float(logps.detach()[i]) for i in chosen) / 4,
            "logps/rejected": sum(float(logps.detach()[i]) for i in rejected) / 6}
    want["rewards/margins"] = want["rewards/chosen"] - want["rewards/rejected"]
    assert set(got) == set(want)
    for name, value in want.items():  # fp32 sums, as TRL's: about -60, where fp32 steps by 4e-6
        assert got[name] == pytest.approx(value, abs=1e-5, rel=1e-6), name


def test_kto_a_side_with_no_row_logs_none_of_its_metrics():
    sums = kl_lib.kto_sums(torch.tensor([-5.0, -6.0]), torch.tensor([-5.5, -6.0]), torch.tensor([True, True]),
                           torch.tensor(0.0), 0.1)
    assert set(kl_lib.metrics(sums.metrics, 2, 0, 0.0)) == {"kl", "rewards/chosen", "logps/chosen"}


def batches(tok, records: list[dict], splits, chunk: int) -> list[dict]:
    encoded = [data.FORMATS["unpaired"].rows.columns(encode_unpaired(r, DataConfig(seq_len=64), tok), None, None)
               for r in records]
    from datasets import Dataset

    stored = with_kl_completions(Dataset.from_list(encoded), chunk, 64).with_format("torch")
    return [collate_unpaired([stored[i] for i in range(a, b)], tok.pad_token_id) for a, b in splits]


def test_kto_any_split_gives_the_loss_kl_point_metrics_and_gradients_of_the_whole_batch(tok):
    """6 demo rows (both sides), then the same rows as micro-batches of 1, 2 and 3 rows, the KL point summed over
    them before any loss as recipes/kto.py's step does: the same loss, z0 (> 0 here), metrics and gradients."""
    lines = ROWS.read_text().splitlines()
    records = [json.loads(lines[i]) for i in (0, 1003, 1, 1004, 1005, 2)]
    policy, reference = tiny_model(1), tiny_model(0)

    def logps(model, batch, kl=False):
        p = "kl_" if kl else ""
        logits = model(input_ids=batch[p + "input_ids"], position_ids=batch[p + "position_ids"]).logits
        return sequence_logps(token_logps(logits, batch[p + "labels"]), batch[p + "labels"])[0]

    def run(splits):
        micro = batches(tok, records, splits, chunk=6)
        with torch.no_grad():
            counts = sum(torch.cat([kl_lib.side_counts(b["label"]).double(),
                                    kl_lib.kl_sums(logps(policy, b, True), logps(reference, b, True)).reshape(1)])
                         for b in micro)
        z0 = kl_lib.kl_point(counts[2], counts[0] + counts[1])
        assert z0 > 0
        policy.zero_grad()
        value, summed = 0.0, torch.zeros(4)
        for b in micro:
            with torch.no_grad():
                ref = logps(reference, b)
            sums = kl_lib.kto_sums(logps(policy, b), ref, b["label"], z0, 0.5, 1.2, 0.8)
            share = kl_lib.objective(sums, counts[0] + counts[1])
            share.backward()
            value += share.item()
            summed += sums.metrics
        return (value, kl_lib.metrics(summed, int(counts[0]), int(counts[1]), z0.item()),
                [p.grad.clone() for p in policy.parameters()])

    assert_splits_match_the_whole_batch(run)


def test_unpaired_records_are_trl_s_format_and_bad_labels_are_named(tok):
    section = DataConfig(seq_len=64)
    row = encode_unpaired({"prompt": "The ball is", "completion": " red.", "label": False}, section, tok)
    assert row.prompt == tok("The ball is")["input_ids"] and row.label is False
    assert row.completion == tok(" red.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    messages = encode_unpaired({"prompt": [{"role": "user", "content": "Hi"}],
                                "completion": [{"role": "assistant", "content": "Hello"}], "label": True}, section,
                               tok)
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                                       tokenize=True, return_dict=True)["input_ids"]
    assert messages.prompt + messages.completion == list(rendered) and messages.completion
    refused = {None: "no field 'label' (true: a desirable completion, false: an undesirable one)",
               "yes": "field 'label' is 'yes' (str), not true or false",
               1: "field 'label' is 1 (int), not true or false"}
    for label, message in refused.items():
        record = {"prompt": "The ball is", "completion": " red."} | ({} if label is None else {"label": label})
        with pytest.raises(BadRecord, match=re.escape(message)):
            encode_unpaired(record, section, tok)


def test_kl_rows_are_trl_s_rotation_within_chunks_and_fit_seq_len(tok):
    """7 rows in chunks of 3: row i of a chunk takes row i-1's completion (the first row the chunk's last), cut to
    fit beside its own prompt; collated, each KL row is its row's prompt then that completion."""
    records = [{"prompt": "The ball is" + " very" * (i % 3), "completion": " red" * (i + 1) + ".",
                "label": i % 2 == 0} for i in range(7)]
    encoded = [data.FORMATS["unpaired"].rows.columns(encode_unpaired(r, DataConfig(seq_len=10), tok), None, None)
               for r in records]
    from datasets import Dataset

    stored = with_kl_completions(Dataset.from_list(encoded), 3, 10)
    for chunk in ((0, 1, 2), (3, 4, 5), (6,)):
        for at, i in enumerate(chunk):
            other = encoded[chunk[at - 1]]["completion_ids"]
            assert stored[i][KL_COMPLETION] == other[:10 - len(encoded[i]["prompt_ids"])]
    assert any(len(stored[i][KL_COMPLETION]) < len(encoded[i - 1]["completion_ids"]) for i in (1, 2, 4, 5))
    batch = collate_unpaired([stored.with_format("torch")[i] for i in range(3)], tok.pad_token_id)
    for i in range(3):
        ids, labels = batch["kl_input_ids"][i], batch["kl_labels"][i]
        n = len(encoded[i]["prompt_ids"])
        assert ids[:n].tolist() == encoded[i]["prompt_ids"]
        assert labels[labels != IGNORE].tolist() == stored[i][KL_COMPLETION]
    assert batch["label"].tolist() == [True, False, True]


def test_unpaired_data_without_labels_stops_in_one_line_naming_the_file(tmp_path, tok):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "The ball is", "completion": " red."}) + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}, line 1: no field 'label'")):
        data.build(DataConfig(path=str(path), format="unpaired", seq_len=64, strict=True), tok, seed=7)
    with pytest.raises(ConfigError, match="the training data yields no rows .*no field 'label'"):
        data.build(DataConfig(path=str(path), format="unpaired", seq_len=64), tok, seed=7)


def test_kto_data_with_one_side_only_says_what_to_do():
    with pytest.raises(ConfigError, match=re.escape(
            "the training data: every one of its 5 rows is desirable (label true); KTO needs undesirable "
            "(label false) rows too: add some (e.g. the rejected responses of preference pairs, label false), or "
            "train on desirable rows alone with recipes/finetune.py")):
        kl_lib.check_sides(5, 0, "the training data")
    with pytest.raises(ConfigError, match=re.escape("every one of its 3 rows is undesirable (label false); KTO "
                                                    "needs desirable (label true) rows too")):
        kl_lib.check_sides(0, 3, "the training data")
    kl_lib.check_sides(1, 1, "the training data")


# ----------------------------------------------------------------------------- end to end

def kto_args(base, *extra: str) -> list[str]:
    return ["model.config=null", f"model.path={base}", "data.format=unpaired",
            "train.max_steps=3", "kto.beta=0.5", "kto.desirable_weight=1.2", "kto.undesirable_weight=0.8", *extra]


SPLITS = {  # name: (ranks, overrides): global batch 4 rows in each; all but fsdp2_pre validate at step 3
    "none": (1, ("parallel.strategy=none",)),
    "none_accum": (1, ("parallel.strategy=none", "train.micro_batch_size=2", "train.grad_accum_steps=2")),
    "ddp": (2, ("parallel.strategy=ddp", "train.micro_batch_size=1", "train.grad_accum_steps=2",
                "train.loss_impl=full")),
    "fsdp2": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=2", "checkpoint.every_steps=2")),
    "fsdp2_pre": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=1", "train.grad_accum_steps=2",
                      "kto.precompute_reference=true")),
    "lora": (1, ("parallel.strategy=none", "lora.enabled=true", "lora.r=4", "lora.alpha=8", "lora.dropout=0")),
}


VALIDATED = ("none", "none_accum", "ddp", "fsdp2", "lora")


def trained(out) -> list[dict]:
    """The training steps' records (not the validation's)."""
    return [r for r in read_metrics(out) if "loss" in r]


def validation(out) -> dict:
    (record,) = [r for r in read_metrics(out) if "val_loss" in r]
    return record


def step_one_losses() -> list:
    """Policy = reference: each row's loss is its weight x (1 - sigmoid(0)); k of the 4 rows desirable."""
    return [pytest.approx(0.5 * (1.2 * k + 0.8 * (4 - k)) / 4, abs=1e-6) for k in range(5)]


@pytest.fixture(scope="session")
def kto_rows(tmp_path_factory):
    """40 demo rows (20 desirable, then 20 undesirable): a file of its own, so its datasets cache (where the
    precomputed reference log-probs go) starts empty, and small, so that precomputing them is quick."""
    out = tmp_path_factory.mktemp("kto_rows") / "rows.jsonl"
    lines = ROWS.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:20] + lines[1000:1020]))
    return out


@pytest.fixture(scope="session")
def kto_val(tmp_path_factory):
    """12 held-out demo rows (6 desirable, then 6 undesirable), none of them in kto_rows."""
    out = tmp_path_factory.mktemp("kto_val") / "val.jsonl"
    lines = ROWS.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[20:26] + lines[1020:1026]))
    return out


@pytest.fixture(scope="session")
def kto_runs(tmp_path_factory, base, kto_rows, kto_val):
    root = tmp_path_factory.mktemp("kto")
    evaluate = (f"data.val_path={kto_val}", "eval.every_steps=3")  # after the last step: training is unchanged
    runs = {name: (root / name, ranks, kto_args(base, f"data.path={kto_rows}", *extra,
                                                *(evaluate if name in VALIDATED else ())), KTO)
            for name, (ranks, extra) in SPLITS.items()}
    results = run_side_by_side(runs, at_once=3)
    for name, res in results.items():
        (root / name / "stdout.log").write_text(res.stdout)
    return {name: root / name for name in runs}


@pytest.mark.slow
def test_kto_losses_and_metrics_match_across_strategies_ranks_accumulation_and_the_precomputed_reference(kto_runs):
    """The KL point is the step's: equal on every split; step 1 (policy = reference) is 1 - sigmoid(0) weighted."""
    want = trained(kto_runs["none"])
    assert len(want) == 3 and want[0]["kl"] == 0 and want[0]["loss"] in step_one_losses()
    assert any(r["kl"] > 0 for r in want[1:]) and want[2]["loss"] not in step_one_losses()
    log = (kto_runs["fsdp2_pre"] / "stdout.log").read_text()
    assert "reference log-probs: computed 40 pairs" in log and "kto: loss kto, beta 0.5, reference frozen copy" in log
    for split in SPLITS:
        if split == "lora":
            continue
        got = trained(kto_runs[split])
        assert len(got) == 3, split
        for g, w in zip(got, want):
            for key in ("loss", *METRICS):
                assert (key in g) == (key in w), (split, g["step"], key)
                if key in w:
                    assert g[key] == pytest.approx(w[key], abs=TOL, rel=REL), (split, g["step"], key)


@pytest.mark.slow
def test_kto_lora_reference_is_the_policy_with_adapters_off(kto_runs):
    """LoRA's B starts at zero, so at step 1 the adapters-off reference equals the policy: every Δ and z0 are 0 and
    the loss is the weighted mean of 1 - sigmoid(0); then the adapters train away from it."""
    out = kto_runs["lora"]
    assert "kto: loss kto, beta 0.5, reference adapters off" in (out / "stdout.log").read_text()
    first, *rest = trained(out)
    assert first["kl"] == 0 and first.get("rewards/chosen", 0) == 0 and first.get("rewards/rejected", 0) == 0
    assert first["loss"] in step_one_losses() and rest[-1]["loss"] not in step_one_losses()


@pytest.mark.slow
def test_kto_resumes_exactly_from_two_ranks_onto_one(tmp_path, kto_runs, base, kto_rows):
    """fsdp2 on 2 ranks checkpointed at step 2, resumed by one process: step 3 as uninterrupted."""
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(kto_runs["fsdp2"] / "checkpoints" / "step_2", out / "checkpoints" / "step_2")
    res = run_recipe(out, *kto_args(base, f"data.path={kto_rows}", "parallel.strategy=none"), script=KTO)
    assert "resumed at step 2" in res.stdout
    (got,) = [r for r in read_metrics(out) if r["step"] == 3]
    (want,) = [r for r in trained(kto_runs["fsdp2"]) if r["step"] == 3]
    for key in ("loss", *METRICS):
        assert (key in got) == (key in want) and got.get(key) == pytest.approx(want.get(key), abs=TOL, rel=REL), key
    assert losses_by_step(out)[3] == pytest.approx(losses_by_step(kto_runs["none"])[3], abs=TOL)


VAL_METRICS = ("val_loss", *(f"val_{k}" for k in METRICS))


@pytest.mark.slow
def test_kto_validation_equals_trl_formulas_over_the_held_out_rows(kto_runs, kto_val, base, tok):
    """Step 3's validation on one process: the trained export and the reference (model.path) score the 12 held-out
    rows and their KL rows (TRL's rotation within chunks of the global batch, 4); z0 over all of them, then each
    row's loss and reward by TRL's formula: val_loss, val_kl and the val_ metrics are those means."""
    from transformers import AutoModelForCausalLM

    got = validation(kto_runs["none"])
    assert got["step"] == 3 and set(got) == {"step", *VAL_METRICS}
    records = [json.loads(line) for line in kto_val.read_text().splitlines()]
    (batch,) = batches(tok, records, [(0, 12)], chunk=4)
    policy, reference = (AutoModelForCausalLM.from_pretrained(path).eval() for path in (kto_runs["none"] / "hf", base))

    def logps(model, kl=False):
        p = "kl_" if kl else ""
        with torch.no_grad():
            logits = model(input_ids=batch[p + "input_ids"], position_ids=batch[p + "position_ids"]).logits
        return sequence_logps(token_logps(logits, batch[p + "labels"]), batch[p + "labels"])[0].tolist()

    assert batch["label"].tolist() == [True] * 6 + [False] * 6
    policy_logps = logps(policy)
    z0 = max(0.0, sum(a - b for a, b in zip(logps(policy, True), logps(reference, True))) / 12)
    rows = [trl_formula("kto", 0.5, 1.2, 0.8, p, r, good, z0)
            for p, r, good in zip(policy_logps, logps(reference), batch["label"].tolist())]
    want = {"val_loss": sum(r[0] for r in rows) / 12, "val_kl": z0,
            "val_rewards/chosen": sum(r[2] for r in rows[:6]) / 6, "val_logps/chosen": sum(policy_logps[:6]) / 6,
            "val_rewards/rejected": sum(r[2] for r in rows[6:]) / 6, "val_logps/rejected": sum(policy_logps[6:]) / 6}
    want["val_rewards/margins"] = want["val_rewards/chosen"] - want["val_rewards/rejected"]
    assert want["val_rewards/margins"] != 0
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=TOL, rel=REL), name


@pytest.mark.slow
def test_kto_validation_is_the_same_on_1_or_2_ranks_strategies_and_accumulation(kto_runs):
    """The held-out set's z0 and means are global, like the training metrics: none, none + accumulation, ddp and
    fsdp2 log the same val_ values; LoRA (adapters-off reference) logs every one of them too."""
    want = validation(kto_runs["none"])
    for split in ("none_accum", "ddp", "fsdp2"):
        got = validation(kto_runs[split])
        assert set(got) == set(want), split
        for key in VAL_METRICS:
            assert got[key] == pytest.approx(want[key], abs=TOL, rel=REL), (split, key)
    lora = validation(kto_runs["lora"])
    assert set(lora) == set(want) and lora["val_loss"] != pytest.approx(want["val_loss"], abs=TOL)


@pytest.mark.slow
def test_kto_bad_input_stops_in_one_line(tmp_path, base, run_setup, kto_rows):
    """Set-up refusals before any process group, and data with one side only stopped once it is read."""
    cases = {("eval.every_steps=5", "data.val_fraction=0.1", "kto.precompute_reference=true"):
             "eval.every_steps: kto.precompute_reference scores the training rows only",
             ("train.loss_impl=liger",): "train.loss_impl: recipes/kto.py takes chunked (the default) or full",
             ("data.format=preference",): "data.format: preference gives pairs rows but this recipe trains on "
                                          "unpaired: set data.format=unpaired",
             ("kto.loss_type=sigmoid",): "kto.loss_type"}
    for i, overrides in enumerate(cases):
        code, _, err = run_setup(KTO, "--config", TINY, f"output_dir={tmp_path / f'bad{i}'}",
                                 *kto_args(base, f"data.path={kto_rows}"), *overrides)
        assert code == 2 and cases[overrides] in err, (overrides, err[-2000:])
        assert "Traceback" not in err
    one_side = tmp_path / "desirable.jsonl"
    one_side.write_text("".join(ROWS.read_text().splitlines(keepends=True)[:8]))
    res = run_recipe(tmp_path / "one_side", *kto_args(base, f"data.path={one_side}"), script=KTO, check=False)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if "KTO needs" in line]
    assert lines == ["error: the training data: every one of its 8 rows is desirable (label true); KTO needs "
                     "undesirable (label false) rows too: add some (e.g. the rejected responses of preference pairs, "
                     "label false), or train on desirable rows alone with recipes/finetune.py"], res.stderr[-2000:]
