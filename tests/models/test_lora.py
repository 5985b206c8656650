"""LoRA (PEFT) on a saved tiny model as model.path: the same losses on every strategy, world size and
accumulation split (also with activation checkpointing, HSDP, auto, compile); the frozen base unchanged bit
for bit, without gradients or optimizer state; exports (final and periodic) that PEFT and transformers load
with the trained logits; adapter-only checkpoints that resume exactly (also at another world size and
strategy) and refuse another base; modules_to_save and init_from; MFU counting weight gradients of the
adapters only."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers import RECIPE, TINY
from helpers.export import assert_export_matches, save_baseline
from helpers.procs import launch, losses, losses_by_step, run_recipe, run_side_by_side
from llmtrain import metrics
from llmtrain.config import ConfigError, load_config
from llmtrain.models import lora, names
from llmtrain.models.hf import build_meta_model, load_model_config, load_tokenizer

TOL = 2e-5
SPLITS = {  # name: (ranks, micro, accum, overrides); global batch 4 rows in each
    "none": (1, 4, 1, ("parallel.strategy=none", "checkpoint.every_steps=2")),
    "auto": (2, 1, 2, ("parallel.strategy=auto",)),  # a tiny base: auto picks ddp
    "fsdp": (2, 2, 1, ("parallel.strategy=fsdp", "checkpoint.every_steps=2", "checkpoint.export_every_steps=2")),
    "fsdp2_ac": (2, 1, 2, ("parallel.strategy=fsdp2", "parallel.activation_checkpointing=true",
                           "checkpoint.every_steps=2")),
    "hsdp": (2, 2, 1, ("parallel.strategy=fsdp2", "parallel.replicate=2")),  # 2 replicas x 1 shard
}


def lora_args(base: Path, *extra: str) -> list[str]:
    return ["model.config=null", f"model.path={base}", "lora.enabled=true", "lora.r=4", "lora.alpha=8",
            "lora.dropout=0", "train.lr=1e-2", *extra]


MODULES_TO_SAVE = ("lora.modules_to_save=[model.norm]", "parallel.strategy=fsdp2", "train.micro_batch_size=2",
                   "train.max_steps=2")

BF16_BASE = ("lora.base_dtype=bf16", "parallel.mixed_precision=bf16", "parallel.strategy=fsdp2",
             "train.micro_batch_size=2")


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory, base) -> dict[str, Path]:
    """The SPLITS, and a run that also trains the final norm (modules_to_save), side by side. The one-process
    run's export gives the baseline logits (none/probe.safetensors) for the other runs' exports."""
    root = tmp_path_factory.mktemp("lora")
    runs = {name: (root / name, ranks, lora_args(base, f"train.micro_batch_size={micro}",
                                                 f"train.grad_accum_steps={accum}", *extra), RECIPE)
            for name, (ranks, micro, accum, extra) in SPLITS.items()}
    runs["modules_to_save"] = (root / "modules_to_save", 2, lora_args(base, *MODULES_TO_SAVE), RECIPE)
    runs["bf16_base"] = (root / "bf16_base", 2, lora_args(base, *BF16_BASE), RECIPE)
    results = run_side_by_side(runs, at_once=len(runs))
    for name, (out, *_) in runs.items():
        (out / "stdout.txt").write_text(results[name].stdout)
    save_baseline(root / "none")
    return {name: out for name, (out, *_) in runs.items()}


@pytest.mark.slow
def test_lora_losses_match_across_strategies_ranks_and_accumulation(lora_runs):
    ref = losses(lora_runs["none"])
    assert len(ref) == 4 and ref[-1] < ref[0], ref  # the adapters learn
    for name in SPLITS:
        assert losses(lora_runs[name]) == pytest.approx(ref, abs=TOL), name
    assert "strategy ddp (auto: " in (lora_runs["auto"] / "stdout.txt").read_text()


@pytest.mark.slow
def test_lora_with_compile_gives_the_same_losses(tmp_path, lora_runs, base):
    """parallel.compile=true (inductor, each decoder layer with its PEFT adapters) under fsdp2 on 2 ranks: the
    uncompiled run's losses. Alone rather than side by side: compiling (twice per rank: the first layer's input
    takes no gradient, the second's does) takes most of a minute of both cores."""
    run_recipe(tmp_path, *lora_args(base, "parallel.strategy=fsdp2", "parallel.compile=true",
                                    "train.micro_batch_size=2"), nproc=2, timeout=600)
    assert losses(tmp_path) == pytest.approx(losses(lora_runs["none"]), abs=TOL)


@pytest.mark.slow
def test_lora_mfu_counts_weight_gradients_of_the_trained_parameters_only(lora_runs, base):
    """The logged model FLOPs are 4N + 2 N_trained + attention (llmtrain/metrics.py), N_trained the adapters."""
    cfg = load_config(TINY, lora_args(base))
    model_config = load_model_config(cfg.model, load_tokenizer(str(base), False))
    model = lora.apply(build_meta_model(model_config, cfg.model), cfg.lora)
    params = {id(p): p for p in model.parameters()}.values()
    n, trained = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    stdout = (lora_runs["none"] / "stdout.txt").read_text()
    assert re.search(r"lora: trainable \S+K of \S+K \(\d+\.\d\d%\)", stdout), stdout
    logged = float(re.search(r"model FLOPs: (\S+) GFLOP per token", stdout).group(1)) * 1e9
    full = metrics.model_flops_per_token(model_config, n, cfg.data.seq_len)
    expected = metrics.model_flops_per_token(model_config, n, cfg.data.seq_len, trained)
    assert expected == full - 2 * (n - trained) and logged == pytest.approx(expected, rel=1e-3), (logged, expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["none", "fsdp", "fsdp2_ac"])
def test_lora_base_unchanged_and_exports_give_trained_logits(lora_runs, base, name):
    """Weight decay is 1.0 (tests/tiny.yaml): a frozen weight in the optimizer would move. The merged export is
    the base, bit for bit where no adapter is, and base + (alpha / r) B @ A of the exported adapter where one is."""
    out = lora_runs[name]
    merged, original = load_file(out / "hf" / "model.safetensors"), load_file(base / "model.safetensors")
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 7 * 2  # lora_A and lora_B of 7 linear layers x 2 decoder layers: complete
    assert all(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)  # started at zero, trained
    assert merged.keys() == original.keys()
    adapted = {k.removeprefix("base_model.model.").replace(".lora_A", ""): (v, adapter[k.replace("lora_A", "lora_B")])
               for k, v in adapter.items() if ".lora_A." in k}
    for key, tensor in original.items():
        if key in adapted:
            a, b = adapted[key]
            torch.testing.assert_close(merged[key], tensor + (8 / 4) * b @ a, rtol=0, atol=1e-6, msg=key)
        else:
            assert torch.equal(merged[key], tensor), f"frozen {key} changed"
    # The optimizer's state (checkpoints/step_4): exactly the trained parameters, the adapters. AdamW makes a
    # parameter's state at its first gradient: every adapter had one, no frozen weight was in the optimizer with one.
    saved = dcp.FileSystemReader(str(out / "checkpoints" / "step_4")).read_metadata().state_dict_metadata
    trained = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    optimized = {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in saved if k.startswith("optim.state.")}
    assert all(names.is_adapter(k) for k in trained) and len(trained) == len(adapter), sorted(trained)[:4]
    assert optimized == trained, sorted(optimized ^ trained)[:4]
    if name != "none":  # the sharded ones: merged in output_dir/hf and base + adapter via PEFT
        assert_export_matches(out, lora_runs["none"] / "probe.safetensors", lora_base=base)


@pytest.mark.slow
def test_lora_checkpoint_holds_adapters_and_resumes_exactly_elsewhere(tmp_path, lora_runs, base):
    """From 1 process (none) at step 2 to 2 ranks on fsdp2 and on fsdp: steps 3-4 as uninterrupted."""
    ckpt = lora_runs["none"] / "checkpoints" / "step_2"
    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys  # no frozen base
    runs = {}
    for strategy in ("fsdp2", "fsdp"):
        out = tmp_path / strategy
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(ckpt, out / "checkpoints" / "step_2")
        runs[strategy] = (out, 2, lora_args(base, f"parallel.strategy={strategy}", "train.micro_batch_size=2"),
                          RECIPE)
    results = run_side_by_side(runs, at_once=2)
    full = losses_by_step(lora_runs["none"])
    for strategy, (out, *_) in runs.items():
        assert "resumed at step 2" in results[strategy].stdout
        got = losses_by_step(out)
        assert [got[s] for s in (3, 4)] == pytest.approx([full[3], full[4]], abs=TOL), strategy


@pytest.mark.slow
def test_lora_resume_refuses_another_base_or_lora_off(tmp_path, lora_runs, base):
    ckpt = lora_runs["none"] / "checkpoints" / "step_2"
    other = tmp_path / "other"
    shutil.copytree(base, other)
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] += 1  # same names, shapes and sizes: only the bytes differ
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    res = run_recipe(tmp_path / "run", *lora_args(other, f"checkpoint.resume={ckpt}"), check=False)
    assert res.returncode == 2 and "was trained on the base" in res.stderr, res.stderr[-2000:]
    with pytest.raises(ConfigError, match="holds LoRA adapters only; set lora.enabled=true"):
        lora.check_resume(ckpt, json.loads((ckpt / "trainer_state.json").read_text())["base"], {})  # LoRA off


@pytest.mark.slow
def test_lora_modules_to_save_and_init_from_round_trip(tmp_path, lora_runs, base):
    """Adapters + the final norm trained on 2 ranks (fsdp2) export completely; a run continuing from that
    adapter directory (one process, a negligible lr) gives the first one's logits (its adapter on the base)."""
    first, second = lora_runs["modules_to_save"], tmp_path / "second"
    adapter = load_file(first / "adapter" / "adapter_model.safetensors")
    assert not torch.equal(adapter["base_model.model.model.norm.weight"],
                           load_file(base / "model.safetensors")["model.norm.weight"])  # trained
    baseline = save_baseline(first)  # the merged export's logits
    assert_export_matches(first, baseline, lora_base=base)
    run_recipe(second, *lora_args(base, *MODULES_TO_SAVE[:1], f"lora.init_from={first / 'adapter'}",
                                  "train.lr=1e-30", "train.max_steps=1", "lora.export=adapter"))
    assert not (second / "hf").exists() and (second / "adapter").is_dir()
    probe = load_file(baseline)
    with torch.no_grad():
        continued = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), second / "adapter")
        diff = continued(input_ids=probe["input_ids"]).logits - probe["logits"]
    assert diff.abs().max() < 1e-5


@pytest.mark.slow
def test_lora_bad_settings_name_the_key(tmp_path, base):
    def load(*overrides):
        return load_config(TINY, lora_args(base, *overrides))

    cfg = load("lora.target_modules=[q_proj,qkv]")
    model = build_meta_model(load_model_config(cfg.model, load_tokenizer(str(base), False)), cfg.model)
    with pytest.raises(ConfigError, match=r"lora.target_modules: \['qkv'\] match no linear layer .*'down_proj', "
                                          r"'gate_proj'"):
        lora.apply(model, cfg.lora)
    for tied in ("embed_tokens", "lm_head"):  # the tiny base ties its embeddings: refused before any work
        with pytest.raises(ConfigError, match=rf"lora.modules_to_save: \['{tied}'\] is tied: model.embed_tokens and "
                                              r"lm_head share one weight .* untie the base first"):
            lora.apply(model, load(f"lora.modules_to_save=[{tied}]").lora)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="lora.init_from: .* has r=8 but lora.r=4"):
        lora.check_init_from(load(f"lora.init_from={adapter}").lora)
    with pytest.raises(ConfigError, match="lora.target_modules: 'qkv': use all-linear or a list"):
        load("lora.target_modules=qkv")
    with pytest.raises(ConfigError, match="lora.base_dtype=bf16 needs parallel.mixed_precision=bf16"):
        load("lora.base_dtype=bf16")
    with pytest.raises(ConfigError, match="lora.base_dtype=bf16: FSDP1 flattens"):
        load(*BF16_BASE, "parallel.strategy=fsdp")


@pytest.mark.slow
def test_lora_bf16_base_trains_close_to_fp32(lora_runs):
    """bf16 storage of the frozen base and bf16 compute (fsdp2): the fp32 run's losses to bf16 precision."""
    assert losses(lora_runs["bf16_base"]) == pytest.approx(losses(lora_runs["none"]), abs=0.03)
    assert load_file(lora_runs["bf16_base"] / "adapter" / "adapter_model.safetensors")[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].dtype == torch.float32


@pytest.mark.slow
def test_lora_periodic_exports_match_the_converter_and_the_final_export(tmp_path, lora_runs, base):
    """checkpoint.export_every_steps=2, 2 ranks of fsdp: adapter/step_2 and hf/step_2 equal, tensor for tensor,
    what the converter makes offline (one process, onto model.path's base) from checkpoints/step_2;
    step_4 (= max_steps) equals the final export; PEFT's adapter/step_2 on the base gives hf/step_2's logits."""
    run = lora_runs["fsdp"]
    res = launch(["-m", "llmtrain.convert", run / "checkpoints" / "step_2", tmp_path], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    for sub, name in (("adapter", lora.ADAPTER_WEIGHTS), ("hf", "model.safetensors")):
        for got, want in ((tmp_path / sub, run / sub / "step_2"), (run / sub / "step_4", run / sub)):
            got, want = load_file(got / name), load_file(want / name)
            assert got.keys() == want.keys(), sub
            for key, tensor in want.items():
                assert torch.equal(got[key], tensor), (sub, key)
    probe = load_file(lora_runs["none"] / "probe.safetensors")  # the final model's logits (baseline)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / "adapter" / "step_2")
    assert get_peft_model_state_dict(adapted).keys() == load_file(run / "adapter" / "step_2" / lora.ADAPTER_WEIGHTS
                                                                  ).keys()  # none missing or unexpected
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(run / "hf" / "step_2")(input_ids=probe["input_ids"]).logits
        assert (adapted(input_ids=probe["input_ids"]).logits - merged).abs().max() < 1e-5
    assert (merged - probe["logits"]).abs().max() > 1e-3  # step 2's model, not the final one


def test_auto_strategy_counts_only_trained_state():
    """A base whose full fine-tuning state would not fit (-> fsdp2) fits with LoRA (-> ddp): frozen weights
    have no gradients or AdamW moments."""
    from llmtrain.config import ParallelConfig
    from llmtrain.parallelize import _device_memory, resolve

    n = int(0.35 * _device_memory(torch.device("cpu")) / 16 * 2)  # twice what auto lets ddp hold
    full = resolve(ParallelConfig(strategy="auto"), n, 2, torch.device("cpu"))
    lora_ = resolve(ParallelConfig(strategy="auto"), n // 100, 2, torch.device("cpu"), frozen_bytes=4 * n)
    assert (full.strategy.name, lora_.strategy.name) == ("fsdp2", "ddp"), (full.reason, lora_.reason)
