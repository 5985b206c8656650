"""On-policy distillation (recipes/distill.py, distill.on_policy_fraction: GKD's lambda) with the tiny reference
run's export as the teacher and a smaller inline student on instruction rows: step 1 of an on-policy run equals
the student's own keyed samples of the rows' prompts (llmtrain.rollout.local in this process) scored by hand
against the teacher's whole logits; a fraction of 0 is the supervised recipe (step 1 by hand on the data's rows,
no on-policy metrics) and an off-policy step of a fraction of 0.5 is that step to the letter; the on_policy flag
of every step is the (train.seed, step) rule, and 1 process and 2 ranks (ddp, fsdp sampling in lockstep, fsdp2
with accumulation) log the same losses and completion metrics at fractions 1 and 0.5; a run resumed from a 2-rank
checkpoint before an on-policy step, on 2 ranks of another strategy or on 1 process, continues as the
uninterrupted run; the refusals (an offline teacher, text rows, trained prompts, packed rows, completions past the
models' positions, a fraction out of [0, 1]) are one line, exit 2, before any process group."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO, TINY
from helpers.distill import BETA, DISTILL, TEMPERATURE, TOP_K, distill_args, reference_kd, seeded_student
from helpers.on_policy import COMPLETIONS, FSDP2_ACCUM, INSTRUCT, NEW, ROWS, SAMPLING_T, SEQ_LEN, on_policy_args
from helpers.procs import read_metrics, run_side_by_side
from llmtrain import data
from llmtrain.config import DataConfig
from llmtrain.models.hf import load_tokenizer, stop_ids
from llmtrain.rollout.on_policy import on_policy
from llmtrain.rollout.local import Sampling, generate

TOL = 2e-5
RUNS = {  # name: (ranks, on_policy_fraction, overrides); global batch 4 rows in each, train.seed 7
    "zero": (1, 0, ("parallel.strategy=none",)),
    "none": (1, 1, ("parallel.strategy=none",)),
    "ddp": (2, 1, ("parallel.strategy=ddp", "train.micro_batch_size=2", "checkpoint.every_steps=2")),
    "fsdp": (2, 1, ("parallel.strategy=fsdp", "train.micro_batch_size=2")),  # sampling in lockstep
    "fsdp2": (2, 1, FSDP2_ACCUM),
    "half": (1, 0.5, ("parallel.strategy=none",)),
    "half_fsdp2": (2, 0.5, (*FSDP2_ACCUM, "checkpoint.every_steps=2")),
}
HALF_FLAGS = [0, 1, 1, 0]  # on_policy(7, step, 0.5) for steps 0-3: uniforms 0.89, 0.28, 0.49, 0.96

@pytest.fixture(scope="module")
def runs(tmp_path_factory, base) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill-on-policy")
    results = run_side_by_side({name: (root / name, ranks, on_policy_args(base, fraction, *extra), DISTILL)
                                for name, (ranks, fraction, extra) in RUNS.items()}, at_once=2)
    for name, res in results.items():
        (root / name / "stdout.log").write_text(res.stdout)
    return {name: root / name for name in RUNS}


def steps(output_dir: Path) -> dict[int, dict]:
    """The last record of each step (a resumed run logs the steps after its checkpoint)."""
    return {r["step"]: r for r in read_metrics(output_dir) if "loss" in r}


def kd_and_ce(student, teacher, rows: list[tuple[list[int], list[int]]], vocab: int) -> tuple[float, float]:
    """KD (test_distill's KD settings) and the student's cross-entropy per trained token of the rows, each row
    (ids, labels: IGNORE where untrained) alone through transformers' forward, with whole logits."""
    logits, targets = ([], []), []
    with torch.no_grad():
        for ids, labels in rows:
            target = torch.tensor(labels[1:])
            keep = target != data.IGNORE
            for out, model in zip(logits, (student, teacher)):
                out.append(model(input_ids=torch.tensor([ids])).logits[0, :-1][keep].float())
            targets.append(target[keep])
    s, t = (torch.cat(x) for x in logits)
    return (reference_kd(s, t, vocab, BETA, TEMPERATURE, TOP_K).mean().item(),
            F.cross_entropy(s, torch.cat(targets)).item())


def step_one(tokenizer) -> dict:
    """Step 1's micro-batch at 1 rank (micro 4): the data's first 4 rows of the global order."""
    built = data.build(DataConfig(path=str(INSTRUCT), format="instruction", seq_len=SEQ_LEN, packing=False),
                       tokenizer, seed=7)
    (batch,) = next(data.make_steps(built, 4, 1, 1, 0, 7, torch.device("cpu"), {}))
    return batch


@pytest.mark.slow
def test_on_policy_step_one_is_the_students_samples_scored_by_hand(runs, base):
    """The student's seeded init samples each row's prompt (the row before its first trained token) keyed
    (seed 7, step 0, sample i), here in this process; KD and CE on those completions, by hand."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(str(REPO / "assets" / "tokenizer"), False)
    batch = step_one(tokenizer)
    trained = [labels.ne(data.IGNORE).nonzero().flatten().tolist() for labels in batch["labels"]]
    # A row that trains nothing (an instruction longer than data.seq_len) is all prompt: one of step 1's.
    assert sum(not t for t in trained) == 1, trained
    prompts = [ids[:t[0] if t else len(ids)].tolist() for ids, t in zip(batch["input_ids"], trained)]
    student = seeded_student(runs["none"] / "hf")
    out = generate(student, prompts, [(7, 0, i) for i in range(4)], Sampling(NEW, SAMPLING_T),
                   stop_ids(student.config.eos_token_id, tokenizer), tokenizer.pad_token_id, torch.device("cpu"))
    completions = [row[:n].tolist() for row, n in zip(out.ids, out.lengths)]
    teacher = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rows = [(p + c, [data.IGNORE] * len(p) + c) for p, c in zip(prompts, completions)]
    kd, ce = kd_and_ce(student, teacher, rows, len(tokenizer))
    got = steps(runs["none"])[1]
    assert got["on_policy"] == 1 and got["trained_tokens"] == sum(map(len, completions)), got
    assert got["completions/mean_length"] == pytest.approx(sum(map(len, completions)) / 4)
    assert got["kd_loss"] == pytest.approx(kd, rel=1e-5) and got["ce_loss"] == pytest.approx(ce, rel=1e-5)
    assert got["loss"] == pytest.approx(0.7 * kd + 0.3 * ce, rel=1e-5)


@pytest.mark.slow
def test_fraction_zero_is_the_supervised_recipe(runs, base):
    from transformers import AutoModelForCausalLM

    zero, half = steps(runs["zero"]), steps(runs["half"])
    assert sorted(zero) == [1, 2, 3, 4]
    assert not any(k in r for r in zero.values() for k in ("on_policy", *COMPLETIONS))
    tokenizer = load_tokenizer(str(REPO / "assets" / "tokenizer"), False)
    batch = step_one(tokenizer)
    teacher = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rows = [(ids.tolist(), labels.tolist()) for ids, labels in zip(batch["input_ids"], batch["labels"])]
    kd, ce = kd_and_ce(seeded_student(runs["zero"] / "hf"), teacher, rows, len(tokenizer))
    assert zero[1]["kd_loss"] == pytest.approx(kd, rel=1e-5) and zero[1]["ce_loss"] == pytest.approx(ce, rel=1e-5)
    # The 0.5 run's step 1 is off-policy: the supervised step to the letter.
    assert half[1]["on_policy"] == 0 and "completions/mean_length" not in half[1]
    assert [half[1][k] for k in ("loss", "kd_loss", "ce_loss", "grad_norm", "trained_tokens")] == \
        [zero[1][k] for k in ("loss", "kd_loss", "ce_loss", "grad_norm", "trained_tokens")]


@pytest.mark.slow
def test_on_policy_losses_and_flags_match_across_ranks_strategies_and_accumulation(runs):
    for want_name, names, fraction in (("none", ("ddp", "fsdp", "fsdp2"), 1.0), ("half", ("half_fsdp2",), 0.5)):
        want = steps(runs[want_name])
        flags = [want[s]["on_policy"] for s in (1, 2, 3, 4)]
        assert flags == [int(on_policy(7, s, fraction)) for s in range(4)], (want_name, flags)
        assert flags == ([1] * 4 if fraction == 1 else HALF_FLAGS)
        lengths = [want[s]["completions/min_length"] for s in want if want[s]["on_policy"]]
        assert min(lengths) < NEW, lengths  # some completions stopped at a stop id
        for s, record in want.items():  # an on-policy step trains its completions' tokens
            if record["on_policy"]:
                assert record["trained_tokens"] == pytest.approx(4 * record["completions/mean_length"])
                assert 1 <= record["completions/min_length"] <= record["completions/max_length"] <= NEW
        for name in names:
            got = steps(runs[name])
            assert sorted(got) == [1, 2, 3, 4], name
            for s in got:
                keys = [k for k in ("on_policy", "trained_tokens", "loss", "kd_loss", "ce_loss", *COMPLETIONS)
                        if k in want[s]]
                assert ("completions/mean_length" in got[s]) == bool(got[s]["on_policy"]), (name, s)
                for k in keys:
                    assert got[s][k] == pytest.approx(want[s][k], abs=TOL), (name, s, k)
                assert got[s]["kd_loss"] == pytest.approx(want[s]["kd_loss"], rel=1e-4), (name, s)  # KD ~ 3e-3


@pytest.mark.slow
def test_on_policy_resumes_exactly_on_the_same_and_another_world_size(tmp_path, runs, base):
    """From step 2 of 2-rank runs (the next step on-policy in both): fraction 1 on 2 fsdp2 ranks (ddp saved it),
    fraction 0.5 on 1 process (fsdp2 with accumulation saved it); steps 3 and 4 as the uninterrupted runs."""
    resumes = {"one_on_two": ("ddp", 2, 1, ("parallel.strategy=fsdp2", "train.micro_batch_size=2")),
               "half_on_one": ("half_fsdp2", 1, 0.5, ("parallel.strategy=none",))}
    for name, (source, *_) in resumes.items():
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(runs[source] / "checkpoints" / "step_2", tmp_path / name / "checkpoints" / "step_2")
    results = run_side_by_side({name: (tmp_path / name, ranks, on_policy_args(base, fraction, *extra), DISTILL)
                                for name, (_, ranks, fraction, extra) in resumes.items()}, at_once=2)
    for name, (source, *_) in resumes.items():
        assert "resumed at step 2" in results[name].stdout, name
        got, want = steps(tmp_path / name), steps(runs[source])
        assert sorted(got) == [3, 4], name
        for s in (3, 4):
            for k in ("on_policy", "loss", "kd_loss", "ce_loss", "trained_tokens"):
                assert got[s][k] == pytest.approx(want[s][k], abs=TOL), (name, s, k)
    assert steps(tmp_path / "half_on_one")[3]["on_policy"] == 1  # resumed into an on-policy step


# -- set-up: one line, exit 2, before any process group (in this process) --

@pytest.fixture(scope="module")
def small_teacher(tmp_path_factory) -> Path:
    """A Hugging Face directory with the tiny tokenizer and a random 1-layer Llama of 64 positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("teacher")
    tokenizer = load_tokenizer(str(REPO / "assets" / "tokenizer"), False)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=64)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_on_policy_refusals_are_one_line_before_any_process_group(tmp_path, small_teacher, run_setup):
    on = (*ROWS, "distill.on_policy_fraction=0.5")
    cases = {
        ("distill.on_policy_fraction=1.5",): "error: distill.on_policy_fraction",
        (*on, f"distill.teacher_logits={tmp_path / 'store'}"):
            "error: distill.teacher_logits: an offline teacher has no log-probs for the tokens the student samples",
        ("distill.on_policy_fraction=1",): "error: data.format: text rows have no prompt",
        (*on, "data.train_on_prompt=true"): "error: data.train_on_prompt: rows that train their prompt",
        (*on, "data.packing=true"): "error: data.packing: a packed row holds several examples",
        (*on, "data.seq_len=64"): "error: distill.max_new_tokens: data.seq_len 64 + 16 sampled tokens is longer than "
                                  "the student's max_position_embeddings=64",
        (*on, "distill.max_new_tokens=17"): "error: distill.max_new_tokens: data.seq_len 48 + 17 sampled tokens",
    }
    for overrides, message in cases.items():
        code, _, err = run_setup(DISTILL, "--config", TINY, f"output_dir={tmp_path / 'out'}",
                                 *distill_args(small_teacher), *overrides)
        assert code == 2 and err.startswith(message), (overrides, err)
        assert len(err.strip().splitlines()) == 1, err
    # 48 + 16 positions fit both models: set-up passes (on to the process group).
    with pytest.raises(AssertionError, match="set-up passed"):
        run_setup(DISTILL, "--config", TINY, f"output_dir={tmp_path / 'out'}", *distill_args(small_teacher), *on)
    code, out, _ = run_setup(DISTILL, "--help-config")
    assert code == 0 and all(f"distill.{k}" in out for k in ("on_policy_fraction", "max_new_tokens",
                                                              "sampling_temperature"))
