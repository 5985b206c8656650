"""LoRA dropout keyed by (seed, step, sample, layer) (llmtrain/models/dropout.py): a row's mask does not depend on
the other rows of its micro-batch, its padding, the rank or a resume; every rank numbers a step's samples alike;
PEFT's nn.Dropout is replaced by it (nothing exported changes; lora.dropout=0 keeps PEFT's identity); and, with
lora.dropout on, real runs of SFT, DPO and GRPO give the same losses on 1 process and 2 ranks and resume exactly
on the same and on another world size."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from helpers import REPO, TINY
from helpers.grpo import write_config
from helpers.procs import finish_recipe, losses_by_step, read_metrics, start_recipe
from llmtrain.config import LoraConfig, ModelConfig
from llmtrain.data import SAMPLE_INDEX, step_batches
from llmtrain.models import dropout, lora
from llmtrain.models.hf import build_meta_model

DEVICE = torch.device("cpu")
TOL = 2e-5


def mask(samples: list[int], shape: tuple[int, ...], step: int = 3, layer: int = 11, p: float = 0.25):
    return dropout.keep_mask(dropout.sample_keys(7, step, torch.tensor(samples)), layer, torch.Size(shape), p, DEVICE)


def test_a_rows_mask_depends_on_its_key_only_not_its_batch_or_padding(monkeypatch):
    whole = mask([0, 1, 2, 3], (4, 20, 16))
    monkeypatch.setattr(dropout, "CHUNK", 20 * 16 + 1)  # computed a row at a time
    assert torch.equal(mask([0, 1, 2, 3], (4, 20, 16)), whole)
    assert whole.float().mean().item() == pytest.approx(0.75, abs=0.02)
    split = mask([2, 3], (2, 33, 16))  # another micro-batch, padded wider
    assert torch.equal(split[:, :20], whole[2:])
    pairs = mask([2, 3], (4, 20, 16))  # DPO: chosen rows then rejected rows of the same samples
    assert torch.equal(pairs[:2], whole[2:]) and not torch.equal(pairs[2:], pairs[:2])
    for other in (mask([0, 1, 2, 3], (4, 20, 16), step=4), mask([0, 1, 2, 3], (4, 20, 16), layer=12),
                  mask([4, 5, 6, 7], (4, 20, 16))):
        assert (other == whole).float().mean().item() == pytest.approx(0.625, abs=0.03)  # unrelated: 0.75^2 + 0.25^2


def test_keyed_dropout_trains_with_keys_only_and_is_the_identity_otherwise():
    module = dropout.KeyedDropout(0.5, layer=3)
    x = torch.ones(2, 5, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="^lora.dropout: a training forward outside llmtrain.train.step.accumulate "
                                           "has no row keys"):
        module(x)
    with dropout.rows(7, 0, torch.tensor([4, 9])):
        y = module(x)
        assert torch.equal(y, x * mask([4, 9], (2, 5, 8), step=0, layer=3, p=0.5) * 2)
    with torch.no_grad():
        assert module(x) is x  # a no-grad forward in training mode (GRPO's sampling-time log-probs)
    assert module.eval()(x) is x


def test_lora_dropout_is_keyed_and_the_state_is_peft_s():
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    on = lora.apply(build_meta_model(config, ModelConfig()), LoraConfig(enabled=True, r=4, dropout=0.1))
    off = lora.apply(build_meta_model(config, ModelConfig()), LoraConfig(enabled=True, r=4, dropout=0.0))
    drops = {n: m for n, m in on.named_modules() if ".lora_dropout." in n}
    assert drops and all(isinstance(m, dropout.KeyedDropout) and m.p == 0.1 for m in drops.values())
    assert len({m.layer for m in drops.values()}) == len(drops)  # every layer its own masks
    assert all(isinstance(m, nn.Identity) for n, m in off.named_modules() if ".lora_dropout." in n)
    assert on.state_dict().keys() == off.state_dict().keys()  # the exports hold what they held


def test_every_rank_numbers_a_steps_samples_alike():
    rows = [{"x": torch.tensor(i)} for i in range(40)]

    def numbered(world: int, micro: int, accum: int) -> dict[int, int]:
        """{row: its index in its step} over two steps (from sample 8 on: rows of the stream differ)."""
        out = {}
        for rank in range(world):
            it = step_batches(rows, micro, accum, world, rank, seed=7, samples_seen=8)
            for _ in range(2):
                for b in next(it):
                    out.update({int(x): int(i) for x, i in zip(b["x"], b[SAMPLE_INDEX])})
        return out

    one = numbered(1, 4, 2)
    assert sorted(one.values()) == sorted([*range(8), *range(8)])  # each step's from 0
    assert numbered(2, 2, 2) == numbered(2, 1, 4) == numbered(4, 1, 2) == one


# -- real runs, lora.dropout on ------------------------------------------------------------------------
LORA = ("lora.enabled=true", "lora.r=4", "lora.alpha=8", "lora.dropout=0.3", "train.lr=1e-2")
FINETUNE, DPO, GRPO = (REPO / "recipes" / f"{n}.py" for n in ("finetune", "dpo", "grpo"))
PAIRS = REPO / "data" / "demo" / "preference.jsonl"


def run_all(root: Path, first: dict, then: dict, config: Path = TINY) -> dict[str, Path]:
    """first: {name: (ranks, overrides, script)}, side by side; then: {name: (ranks, overrides, script, (a run
    of first, the step of its checkpoint to resume from))}."""
    out = {}
    for wave in (first, then):
        running = []
        for name, (ranks, overrides, script, *resume) in wave.items():
            target = root / name
            if resume:
                source, step = resume[0]
                (target / "checkpoints").mkdir(parents=True)
                shutil.copytree(out[source] / "checkpoints" / f"step_{step}", target / "checkpoints" / f"step_{step}")
            running.append((name, target, resume, start_recipe(target, *overrides, nproc=ranks, config=config,
                                                               script=script)))
        for name, target, resume, proc in running:
            res = finish_recipe(proc)
            assert ("resumed at step" in res.stdout) == bool(resume), name
            out[name] = target
    return out


@pytest.mark.slow
def test_sft_lora_with_dropout_same_losses_on_any_split_and_resumes_exactly(tmp_path):
    two = ("parallel.strategy=ddp", "train.micro_batch_size=1", "train.grad_accum_steps=2")
    runs = run_all(tmp_path, {
        "one": (1, (*LORA, "checkpoint.every_steps=2"), FINETUNE),
        "two": (2, (*LORA, *two), FINETUNE),
        "no_dropout": (1, (*LORA, "lora.dropout=0"), FINETUNE),
    }, {
        "same": (1, LORA, FINETUNE, ("one", 2)),
        "other": (2, (*LORA, "parallel.strategy=fsdp2", "train.micro_batch_size=2"), FINETUNE, ("one", 2)),
    })
    whole = losses_by_step(runs["one"])
    assert losses_by_step(runs["two"]) == pytest.approx(whole, abs=TOL)
    assert abs(losses_by_step(runs["no_dropout"])[2] - whole[2]) > 1e-4  # the dropout is on
    for name in ("same", "other"):
        got = losses_by_step(runs[name])
        assert [got[s] for s in (3, 4)] == pytest.approx([whole[3], whole[4]], abs=TOL), name


@pytest.mark.slow
def test_dpo_lora_with_dropout_same_losses_on_any_split_and_resumes_exactly(tmp_path, base):
    dpo = ("model.config=null", f"model.path={base}", f"data.path={PAIRS}", "data.format=preference",
           "train.max_steps=3", "dpo.loss=sigmoid", "dpo.beta=0.5", "dpo.sft_weight=0.5", *LORA)
    runs = run_all(tmp_path, {
        "one": (1, (*dpo, "checkpoint.every_steps=2"), DPO),
        "two": (2, (*dpo, "parallel.strategy=fsdp2", "train.micro_batch_size=1", "train.grad_accum_steps=2"), DPO),
    }, {
        "same": (1, dpo, DPO, ("one", 2)),
        "other": (2, (*dpo, "parallel.strategy=ddp", "train.micro_batch_size=2"), DPO, ("one", 2)),
    })
    whole = read_metrics(runs["one"])
    for got in (read_metrics(runs[name]) for name in ("two", "same", "other")):
        by_step = {r["step"]: r for r in got}
        for want in whole[-len(got):]:
            for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected"):
                assert by_step[want["step"]][key] == pytest.approx(want[key], abs=1e-5, rel=1e-6), (want["step"], key)


@pytest.mark.slow
def test_grpo_lora_with_dropout_same_losses_on_any_split_and_resumes_exactly(tmp_path):
    config = write_config(tmp_path)
    steps = ("train.max_steps=4", "log.completions_every_steps=0")
    runs = run_all(tmp_path, {
        "one": (1, (*LORA, *steps, "checkpoint.every_steps=3"), GRPO),  # step 3: in the middle of a generation batch
        "two": (2, (*LORA, *steps, "parallel.strategy=ddp", "train.micro_batch_size=3"), GRPO),  # a group on both ranks
    }, {
        "same": (1, (*LORA, *steps), GRPO, ("one", 3)),
        "other": (2, (*LORA, *steps, "parallel.strategy=fsdp2", "train.micro_batch_size=2", "train.grad_accum_steps=3"),
                  GRPO, ("one", 3)),
    }, config=config)
    whole = {r["step"]: r for r in read_metrics(runs["one"])}
    for name in ("two", "same", "other"):
        for got in read_metrics(runs[name]):
            for key in ("loss", "reward", "kl", "grad_norm", "completions/mean_length"):
                assert got[key] == pytest.approx(whole[got["step"]][key], abs=2e-5), (name, got["step"], key)
