"""recipes/dpo.py on the saved tiny model (the reference run's export) and data/demo/preference.jsonl:
the logged loss and TRL-named metrics at step 1 equal the formulas below computed in transformers on the
same weights and batch (DPO with label smoothing and an SFT term; IPO with a LoRA policy whose reference
is the base with its adapters off; SimPO without a reference); the same losses for ddp / fsdp / fsdp2 on
2 ranks, micro-batches or accumulation, chunked log-probs (the default) or full logits (ddp); the val_*
metrics are the same formulas on the held-out pairs, on 1 or 2 ranks; exact resume on another strategy;
an export transformers loads; precomputed reference
log-probs (dpo.precompute_reference) give the live reference's losses, are reused at another world size
and by a LoRA run on the same base, and a damaged cache piece is computed again."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import RECIPE, TINY
from helpers.pairs import DPO, PAIRS, dpo_args, first_batch, sequence_logps
from helpers.procs import losses_by_step, read_metrics, run_recipe, run_side_by_side

TOL = 2e-5
# logps/* are sums over a response's tokens (about -80 here), where fp32 steps by 8e-6: 1e-5 absolute is 1-2 ulp,
# so the metrics also pass within 1e-6 relative (the losses stay below 10: the absolute bound decides for them).
REL = 1e-6
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
SIGMOID = ("dpo.loss=sigmoid", "dpo.beta=0.5", "dpo.label_smoothing=0.1", "dpo.sft_weight=0.5")
SIMPO = ("dpo.loss=simpo", "dpo.beta=2.0", "dpo.gamma=0.5", "dpo.label_smoothing=0.1", "train.max_steps=1")
PRECOMPUTE = "dpo.precompute_reference=true"
LORA_IPO = ("dpo.loss=ipo", "dpo.beta=0.5", "lora.enabled=true", "lora.r=4", "lora.alpha=8", "lora.dropout=0",
            "train.max_steps=1")


@pytest.fixture(scope="session")
def lora_init(tmp_path_factory, base) -> Path:
    """A PEFT adapter with random (non-zero) A and B, so that the policy differs from the reference at step 1."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                      init_lora_weights=False))
    out = tmp_path_factory.mktemp("lora_init")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def val_pairs(tmp_path_factory) -> Path:
    """5 held-out pairs: on 2 ranks of 2 pairs a micro-batch, rank 1's second batch is eval's filler."""
    out = tmp_path_factory.mktemp("dpo_val") / "val.jsonl"
    out.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[-5:]))
    return out


@pytest.fixture(scope="session")
def dpo_runs(tmp_path_factory, base, lora_init, val_pairs) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dpo")
    # A copy of the pairs has a datasets cache of its own: the precomputed reference log-probs start absent.
    pairs = shutil.copy(PAIRS, root / "pairs.jsonl")
    val = (f"data.val_path={val_pairs}", "eval.every_steps=3")  # at the last step
    runs = {  # name: (ranks, overrides); global batch 4 pairs in each
        "none": (1, ("parallel.strategy=none", "checkpoint.every_steps=2", *val, *SIGMOID)),
        "ddp": (2, ("parallel.strategy=ddp", "train.micro_batch_size=1", "train.grad_accum_steps=2",
                    "train.loss_impl=full", *SIGMOID)),
        "fsdp": (2, ("parallel.strategy=fsdp", "train.micro_batch_size=2", *val, *SIGMOID)),
        "fsdp2": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=1", "train.grad_accum_steps=2", *SIGMOID)),
        "fsdp2_pre": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=2", f"data.path={pairs}", PRECOMPUTE,
                          *SIGMOID)),
        "simpo": (1, ("parallel.strategy=none", *val, *SIMPO)),
        "lora_ipo": (1, ("parallel.strategy=none", f"lora.init_from={lora_init}", *LORA_IPO)),
    }
    results = run_side_by_side({name: (root / name, ranks, dpo_args(base, *extra), DPO)
                                for name, (ranks, extra) in runs.items()}, at_once=3)
    for name, res in results.items():
        (root / name / "stdout.log").write_text(res.stdout)
    return {name: root / name for name in runs}


def expected(loss: str, policy, reference, batch, beta: float, smoothing: float = 0.0, gamma: float = 0.0,
             sft_weight: float = 0.0) -> dict[str, float]:
    """The papers' formulas (module docstring of llmtrain/losses/preference.py), with TRL's metric names."""
    (pc, pr), (nc, nr) = (t.chunk(2) for t in sequence_logps(policy, batch))
    if loss == "simpo":
        ac, ar = pc / nc, pr / nr
        z = beta * (ac - ar) - gamma
        losses = -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
        rc, rr, lc, lr = beta * ac, beta * ar, ac, ar
    else:
        qc, qr = sequence_logps(reference, batch)[0].chunk(2)
        rc, rr, lc, lr = beta * (pc - qc), beta * (pr - qr), pc, pr
        if loss == "sigmoid":
            z = rc - rr
            losses = -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
        else:
            losses = ((pc - qc) / nc - (pr - qr) / nr - 1 / (2 * beta)) ** 2
    total = losses.mean() + sft_weight * (-pc.sum() / nc.sum())
    values = (rc.mean(), rr.mean(), (rc > rr).float().mean(), (rc - rr).mean(), lc.mean(), lr.mean())
    return {"loss": total.item(), **{k: v.item() for k, v in zip(METRICS, values)}}


@pytest.mark.slow
def test_dpo_step_one_equals_the_formulas(dpo_runs, base, lora_init):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load():
        return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()

    batch, reference = first_batch(), load()
    cases = {"none": expected("sigmoid", load(), reference, batch, 0.5, 0.1, sft_weight=0.5),
             "simpo": expected("simpo", load(), None, batch, 2.0, 0.1, gamma=0.5),
             "lora_ipo": expected("ipo", PeftModel.from_pretrained(load(), lora_init).eval(), reference, batch, 0.5)}
    assert cases["lora_ipo"]["rewards/margins"] != 0  # the policy is not the reference at step 1
    for name, want in cases.items():
        got = read_metrics(dpo_runs[name])[0]
        assert got["step"] == 1
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-5, rel=REL), (name, key)


def margins(output_dir: Path) -> list[float]:
    return [r["rewards/margins"] for r in read_metrics(output_dir) if "loss" in r]  # training records


@pytest.mark.slow
def test_dpo_losses_match_across_strategies_ranks_and_accumulation(dpo_runs):
    want = losses_by_step(dpo_runs["none"])
    assert len(want) == 3
    for name in ("ddp", "fsdp", "fsdp2"):
        got = losses_by_step(dpo_runs[name])
        assert got == pytest.approx(want, abs=TOL), name
        assert margins(dpo_runs[name]) == pytest.approx(margins(dpo_runs["none"]), abs=TOL), name


@pytest.mark.parametrize("policy", ["fsdp", "fsdp2"])
def test_frozen_copy_gives_every_gathered_unit_back_after_forward(single_process_group, policy):
    """A trained fsdp2 model keeps its root and last layer gathered after forward, for the backward that
    follows; the reference (Strategy.frozen) runs no backward, so it keeps nothing gathered between forwards
    (FSDP1 would hold its root unit whole until a backward: its frozen copy is FSDP2's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.config import ParallelConfig
    from llmtrain.parallelize import STRATEGIES

    def gathered_after_forward(strategy) -> set[str]:
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=3, num_attention_heads=2))
        model = strategy.wrap(model, ParallelConfig(strategy=policy), torch.float32, init_device_mesh("cpu", (1,)),
                              torch.device("cpu"))
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
            model(torch.zeros(1, 4, dtype=torch.long))
        return {n.split(".weight")[0] for n, p in model.named_parameters() if not isinstance(p, DTensor)}

    assert gathered_after_forward(STRATEGIES[policy].frozen()) == set()
    if policy == "fsdp2":
        assert gathered_after_forward(STRATEGIES["fsdp2"]) >= {"model.embed_tokens", "lm_head", "model.norm",
                                                             "model.layers.2.mlp.up_proj"}


@pytest.mark.slow
def test_dpo_eval_is_the_training_formula_on_the_val_pairs_on_any_ranks(dpo_runs, base, val_pairs):
    """eval.every_steps: val_loss and val_* (TRL's names) at the last step equal the formulas on all 5 val pairs
    with the trained weights (the export), and 2 ranks (uneven, with a filler batch) log what 1 logs."""
    from transformers import AutoModelForCausalLM

    def load(path: Path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    val = first_batch(val_pairs, pairs=5)
    cases = {"none": expected("sigmoid", load(dpo_runs["none"] / "hf"), load(base), val, 0.5, 0.1, sft_weight=0.5),
             "simpo": expected("simpo", load(dpo_runs["simpo"] / "hf"), None, val, 2.0, 0.1, gamma=0.5)}
    logged = {name: [r for r in read_metrics(dpo_runs[name]) if "val_loss" in r] for name in ("none", "fsdp", "simpo")}
    assert [r["step"] for r in logged["none"]] == [3] and [r["step"] for r in logged["simpo"]] == [1]
    for name, want in cases.items():
        for key, value in want.items():
            assert logged[name][0][f"val_{key}"] == pytest.approx(value, abs=1e-5, rel=REL), (name, key)
    for key in ("val_loss", *(f"val_{m}" for m in METRICS)):
        assert logged["fsdp"][0][key] == pytest.approx(logged["none"][0][key], abs=TOL, rel=REL), key


@pytest.mark.slow
def test_dpo_resumes_exactly_elsewhere_and_exports(tmp_path, dpo_runs, base):
    """From one process at step 2 to fsdp2 on 2 ranks: step 3 as uninterrupted (the reference rebuilt from
    model.path, the policy from the checkpoint); the export loads in transformers as the trained model."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(dpo_runs["none"] / "checkpoints" / "step_2", out / "checkpoints" / "step_2")
    res = run_recipe(out, *dpo_args(base, "parallel.strategy=fsdp2", "train.micro_batch_size=2", *SIGMOID),
                     nproc=2, script=DPO)
    assert "resumed at step 2" in res.stdout
    assert losses_by_step(out)[3] == pytest.approx(losses_by_step(dpo_runs["none"])[3], abs=TOL)
    exported = AutoModelForCausalLM.from_pretrained(dpo_runs["none"] / "hf", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert not torch.equal(exported.model.norm.weight, original.model.norm.weight)  # trained, not the base


def assert_same_metrics(got: Path, want: Path, steps: int = 3) -> None:
    """The loss and every reward metric of each step, < 1e-5 (or 1e-6 relative: the summed log-probs)."""
    pairs = list(zip(read_metrics(got), read_metrics(want)))
    assert len(pairs) == steps
    for g, w in pairs:
        for key in ("loss", *METRICS):
            assert g[key] == pytest.approx(w[key], abs=1e-5, rel=REL), (g["step"], key)


@pytest.mark.slow
def test_dpo_precomputed_reference_equals_the_live_one(dpo_runs):
    """2 ranks, fsdp2: the reference scores every pair once before training (another micro-batch split than
    the live run's), then is freed; each step's loss and metrics are the live frozen reference's."""
    assert "reference log-probs: computed 1000 pairs" in (dpo_runs["fsdp2_pre"] / "stdout.log").read_text()
    assert_same_metrics(dpo_runs["fsdp2_pre"], dpo_runs["fsdp2"])


@pytest.mark.slow
def test_dpo_precomputed_reference_is_reused_and_a_damaged_piece_recomputed(tmp_path, dpo_runs, base,
                                                                          lora_init):
    """One process reads the cache the fsdp2 run filled: a torn piece is computed again (not read), the others
    are reused, and the losses are the live reference's; then a run finds the cache whole and builds no reference,
    and a LoRA run on the same base reuses it too (its reference is the base) with the losses of adapters off."""
    log = (dpo_runs["fsdp2_pre"] / "stdout.log").read_text()
    where = Path(re.search(r"reference log-probs: computed .*, cached in (\S+)", log).group(1))
    pieces = sorted(where.glob("pairs-*.pt"))
    assert len(pieces) == 4  # 1000 pairs, 256 a piece
    torn = pieces[1]
    torn.write_bytes(torn.read_bytes()[:300])
    where_pairs = dpo_runs["none"].parent / "pairs.jsonl"
    args = dpo_args(base, "parallel.strategy=none", f"data.path={where_pairs}", PRECOMPUTE, *SIGMOID)
    res = run_recipe(tmp_path / "torn", *args, script=DPO)
    assert f"reference log-probs: {torn} is damaged" in res.stdout, res.stdout[-3000:]
    assert "reference log-probs: computed 256 pairs" in res.stdout and "(744 reused)" in res.stdout
    assert_same_metrics(tmp_path / "torn", dpo_runs["none"])
    res = run_recipe(tmp_path / "whole", *args, "train.max_steps=1", script=DPO)
    assert f"reference log-probs: reused {where} (1000 pairs)" in res.stdout, res.stdout[-3000:]
    assert_same_metrics(tmp_path / "whole", dpo_runs["none"], steps=1)
    res = run_recipe(tmp_path / "lora", *dpo_args(base, "parallel.strategy=none", f"data.path={where_pairs}",
                                                   PRECOMPUTE, f"lora.init_from={lora_init}", *LORA_IPO), script=DPO)
    assert f"reference log-probs: reused {where} (1000 pairs)" in res.stdout, res.stdout[-3000:]
    assert_same_metrics(tmp_path / "lora", dpo_runs["lora_ipo"], steps=1)


@pytest.mark.slow
def test_dpo_bad_settings_name_the_key(tmp_path, base, run_setup):
    cases = {("data.format=text",): "data.format=preference", ("train.loss_impl=liger",): "train.loss_impl",
             ("model.path=outputs/nowhere/hf",): "recipes/finetune.py --config configs/demo.yaml",
             ("dpo.loss=simpo", PRECOMPUTE): "dpo.precompute_reference: dpo.loss=simpo uses no reference model",
             (PRECOMPUTE, "eval.every_steps=1", "data.val_fraction=0.2"):
                 "set eval.every_steps=0 or dpo.precompute_reference=false"}
    for i, overrides in enumerate(cases):  # in this process: each stops in its set-up
        args = [a for a in dpo_args(base) if not a.startswith(tuple(o.split("=")[0] + "=" for o in overrides))]
        code, _, err = run_setup(DPO, "--config", TINY, f"output_dir={tmp_path / f'bad{i}'}", *args, *overrides)
        assert code == 2 and cases[overrides] in err, (overrides, err[-2000:])
        assert "Traceback" not in err
    code, _, err = run_setup(RECIPE, "--config", TINY, f"output_dir={tmp_path / 'sft'}", *dpo_args(base))
    assert code == 2 and "recipes/dpo.py" in err, err[-2000:]  # pairs are not SFT data
