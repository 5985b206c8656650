"""Ulysses sequence parallelism (parallel.sp_size, llmtrain/models/ulysses.py): the split changes no number. The
set-up refusals (one line each, before any process group), the whole rows' mask, then on real gloo ranks: each
loss path's loss and gradients at sp 2 equal the unsplit ones (tests/scripts/ulysses_grads.py), and SFT with packing
(full and LoRA, a tiny Llama and a tiny Qwen3 with GQA) gives the losses and gradient norms of sp_size 1 at
sp_size 2 on 2 ranks, and at 2 data-parallel groups x sp_size 2 on 4 ranks; a resume of the sp_size 2 run on one
process continues exactly."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import RECIPE, REPO, TINY
from helpers.families import make_family
from helpers.procs import launch, read_metrics, run_recipe
from helpers.runs import REFERENCE, Run
from llmtrain.config import ConfigError
from llmtrain.models import ulysses

TOL = 1e-5
SP2 = ("parallel.strategy=fsdp2", "parallel.sp_size=2")
SAVED = ("checkpoint.every_steps=2",)  # the sp 2 run's step 2, for the resume on one process


@pytest.mark.parametrize("args, says", [
    ((4, 2, 64, ulysses.KERNEL, 4, 2), "parallel.sp_size=4 must divide the world size 2"),
    ((2, 6, 64, ulysses.KERNEL, 4, 2), None),
    ((3, 3, 64, ulysses.KERNEL, 4, 2), "data.seq_len=64 is not divisible by parallel.sp_size=3"),
    ((3, 3, 63, ulysses.KERNEL, 4, 2), "must divide the model's 4 attention heads"),
    ((4, 4, 64, ulysses.KERNEL, 8, 3), "the model's 3 key/value heads and parallel.sp_size=4"),
    ((4, 4, 64, ulysses.KERNEL, 8, 1), None),  # one key/value head: replicated on the 4 ranks
    ((2, 2, 64, "eager", 4, 2), "this model gets eager"),
])
def test_check_refuses_in_one_line(args, says):
    if says is None:
        ulysses.check(*args)
        return
    with pytest.raises(ConfigError) as e:
        ulysses.check(*args)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, world, says", [
    (["parallel.sp_size=2"], 1, "parallel.sp_size=2 must divide the world size 1"),
    (["parallel.sp_size=2", "data.seq_len=63"], 2, "data.seq_len=63 is not divisible by parallel.sp_size=2"),
    (["parallel.sp_size=3", "data.seq_len=63"], 3, "parallel.sp_size=3 must divide the model's 4 attention heads"),
])
def test_setup_refuses_before_the_process_group(run_setup, overrides, world, says):
    code, out, err = run_setup(RECIPE, "--config", TINY, "parallel.strategy=ddp", *overrides, world_size=world)
    assert code == 2 and err.strip().startswith(f"error: {says}"), err
    assert len(err.strip().splitlines()) == 1, err


def test_other_recipes_refuse_sp_in_one_line(run_setup):
    code, _, err = run_setup(REPO / "recipes" / "grpo.py", "--config", REPO / "configs" / "demo-grpo.yaml",
                             "parallel.sp_size=2", world_size=2)
    assert code == 2 and "sequence parallelism is not supported by the grpo recipe" in err
    assert len(err.strip().splitlines()) == 1, err


def test_mask_is_causal_within_each_run_of_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    seg = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    want = (seg[:, None] == seg[None, :]) & torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(ulysses.segments_mask(pos)[0, 0], want)


@pytest.mark.slow
def test_split_loss_and_gradients_equal_the_whole_rows(tmp_path):
    res = launch([REPO / "tests" / "scripts" / "ulysses_grads.py", tmp_path / "g.json"], nproc=2, timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    results = json.loads((tmp_path / "g.json").read_text())
    kinds = {"packed/64", "padded/63", "recompute/64"}
    assert set(results) == {f"{f}/{loss}{i}/{k}" for f in ("llama", "qwen3") for loss in ("", "logps/")
                            for i in ("full", "chunked") for k in kinds if i == "chunked" or k != "recompute/64"}
    for case, got in results.items():
        whole, split = got["loss"]
        assert split == pytest.approx(whole, rel=TOL), case
        assert got["grad_rel"] <= TOL, case


def steps(out) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(out) if "loss" in r]


def assert_same_steps(got, want, what):
    assert len(got) == len(want) == 4, what
    for (loss, norm), (ref_loss, ref_norm) in zip(got, want):
        assert loss == pytest.approx(ref_loss, abs=TOL), what
        assert norm == pytest.approx(ref_norm, rel=TOL), what


@pytest.mark.slow
def test_sft_packing_full_and_lora_at_sp2_match_sp1(shared_runs, tmp_path_factory):
    """sp 2 on 2 ranks and 2 data-parallel x sp 2 on 4 ranks. Packed rows (tests/tiny.yaml); LoRA with its
    keyed dropout on (lora.dropout 0.05: masks by whole-row positions); the Qwen3 family's tiny model (2 key/value
    heads, per-head q/k norms)."""
    qwen3 = make_family("qwen3", tmp_path_factory.mktemp("qwen3") / "qwen3")
    qwen = (f"model.path={qwen3}", "model.config=null", f"tokenizer.path={qwen3}")
    lora = ("lora.enabled=true",)
    runs = {"ref": REFERENCE, "sp2": Run((*SP2, *SAVED), nproc=2),
            "dp2_sp2": Run((*SP2, "train.micro_batch_size=2"), nproc=4),  # 2 data-parallel x 2: global batch 4
            "lora_ref": Run(("parallel.strategy=none", *lora)), "lora_sp2": Run((*SP2, *lora), nproc=2),
            "qwen_ref": Run(("parallel.strategy=none", *qwen)), "qwen_sp2": Run((*SP2, *qwen), nproc=2)}
    outs = shared_runs.get(runs, at_once=2)
    for name in ("sp2", "lora_sp2", "qwen_sp2"):
        assert_same_steps(steps(outs[name]), steps(outs[name.replace("sp2", "ref")]), name)
    assert_same_steps(steps(outs["dp2_sp2"]), steps(outs["ref"]), "dp2_sp2")
    # resumed from the sp 2 run's step 2 on one process (sp_size 1): steps 3 and 4 as the reference's
    resumed = tmp_path_factory.mktemp("resumed")
    run_recipe(resumed, "parallel.strategy=none", f"checkpoint.resume={outs['sp2'] / 'checkpoints' / 'step_2'}")
    assert [r["step"] for r in read_metrics(resumed) if "loss" in r] == [3, 4]
    assert_same_steps(steps(outs["ref"])[:2] + steps(resumed), steps(outs["ref"]), "resumed at sp_size 1")
