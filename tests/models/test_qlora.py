"""QLoRA's NF4 base (llmtrain/models/nf4.py): which weights, the round-trip bound, the quantized model equal to
LoRA on the dequantized base, and 2-rank fsdp2/ddp (gloo) equal to one process, the non-dividing fsdp2 shards
included. The 2-rank and memory workers are tests/scripts/qlora_ranks.py and qlora_memory.py."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import REPO
from helpers.qlora import QLORA, SEED, build, dequantized_base, model_config, step
from llmtrain.config import ConfigError, LoraConfig, ModelConfig
from llmtrain.models import lora, nf4
from llmtrain.models.hf import build_meta_model

SCRIPTS = REPO / "tests" / "scripts"

# NF4's 16 codes (QLoRA, Dettmers et al. 2023, appendix E) are at most 0.3038 apart (-1 to -0.6962): a weight
# scaled by its block's absmax lands at most 0.1519 from its code. The scale itself is stored as int8 steps
# of 2 * max|scale - mean| / 256 over its group of 256: at most half a step off, times |code| <= 1.
CODE_HALF_GAP = 0.1519


@pytest.fixture
def nf4_none(single_process_group):
    model, report = build("none", QLORA)
    return model, report, step(model)


def test_plan_takes_the_block_linears_only_and_ignores_the_strategy():
    model, _ = lora.prepare(build_meta_model(model_config(), ModelConfig()), QLORA, SEED)
    chosen = nf4.plan(model, QLORA)
    per_layer = {n.split(".", 3)[3] for n in chosen.quantized}
    assert per_layer == {f"{m}.base_layer.weight" for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                           "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                                                           "mlp.up_proj", "mlp.down_proj")}
    assert len(chosen.quantized) == 14 and not chosen.skipped
    # scaler groups from the shape alone: 2816 blocks is 11 groups of 256
    assert chosen.quantized["model.layers.0.mlp.up_proj.base_layer.weight"] == 256
    # a block size that does not divide a weight leaves it in full precision, named
    odd = nf4.plan(model, replace(QLORA, nf4_block_size=176))
    assert "model.layers.0.mlp.up_proj.base_layer.weight" in odd.quantized  # 704 * 256 = 1024 * 176
    assert odd.skipped["model.layers.0.self_attn.k_proj.base_layer.weight"].startswith("(128, 256) is not a multiple")
    # only the targeted layers get adapters; the others are quantized all the same
    attn_only = replace(QLORA, target_modules=["q_proj"])
    model, _ = lora.prepare(build_meta_model(model_config(), ModelConfig()), attn_only, SEED)
    assert len(nf4.plan(model, attn_only).quantized) == 14
    assert nf4.plan(model, replace(attn_only, quantize_base="none")).quantized == {}


def test_round_trip_error_within_the_nf4_bound_and_equal_to_torchao(monkeypatch):
    from torchao.quantization import to_nf4

    monkeypatch.setattr(nf4, "CHUNK", 6400)  # several chunks per weight, the last one short

    g = torch.Generator().manual_seed(0)
    for shape, scaler in (((704, 256), 256), ((128, 256), 256), ((32, 64), 32)):
        w = torch.randn(shape, generator=g) * 0.02
        q = nf4._quantize_local(w, 64, scaler, None)
        back = nf4.dequantized(q)
        assert torch.equal(back, to_nf4(w, 64, scaler).get_original_weight())
        blocks = w.reshape(-1, 64)
        absmax = blocks.abs().amax(dim=1)
        scale_step = 2 * (absmax - absmax.mean()).reshape(-1, scaler).abs().amax(dim=1) / 256
        bound = CODE_HALF_GAP * absmax + scale_step.repeat_interleave(scaler) / 2
        err = (back - w).reshape(-1, 64).abs().amax(dim=1)
        assert (err <= bound * (1 + 1e-6)).all(), (err / bound).max()
        assert (err / bound).max() > 0.98  # measured 0.989-0.996: the bound is tight
        # a Gaussian weight's relative error: ||W - dq(q(W))|| / ||W|| measured 0.092-0.094
        assert 0.085 < (back - w).norm() / w.norm() < 0.1
        # 4 bits + an int8 scale per 64 + an fp32 factor per 64 * scaler + the mean
        assert nf4.nbytes(q) == w.numel() // 2 + w.numel() // 64 + 4 * w.numel() // (64 * scaler) + 4


def test_nf4_base_computes_what_lora_on_the_dequantized_base_computes(nf4_none, single_process_group):
    from torchao.quantization import to_nf4

    model, report, got = nf4_none
    assert report.weights == 14 and not report.skipped and not report.finer_groups
    assert 0.25 < report.nf4_bytes / report.bf16_bytes < 0.27, report.describe()
    assert "0.258x" in report.describe()
    ref_model, ref_report = build("none", replace(QLORA, quantize_base="none"))
    assert ref_report.weights == 0
    quantized = dict(model.named_parameters())
    with torch.no_grad():
        for name, scaler in nf4.plan(ref_model, QLORA).quantized.items():
            p = ref_model.get_parameter(name)
            assert nf4.is_nf4(quantized[name]) and not nf4.is_nf4(p)
            p.copy_(to_nf4(p.detach().clone(), 64, scaler).get_original_weight())
    want = step(ref_model)
    assert (got["logits"] - want["logits"]).abs().max() < 1e-5
    assert got["grads"].keys() == want["grads"].keys() and len(got["grads"]) == 28
    for name, g in got["grads"].items():
        assert g.abs().max() > 0, name
        assert (g - want["grads"][name]).abs().max() < 1e-5, name
    assert abs(got["losses"][1] - want["losses"][1]) < 1e-5 and got["losses"][1] < got["losses"][0]


def test_setup_errors_name_the_key_and_the_fix(monkeypatch):
    nf4.check(QLORA, "fsdp2")
    nf4.check(LoraConfig(), "fsdp")
    with pytest.raises(ConfigError, match="parallel.strategy=fsdp2"):
        nf4.check(QLORA, "fsdp")
    with pytest.raises(ConfigError, match="lora.enabled=true"):
        nf4.check(replace(QLORA, enabled=False), "none")
    with pytest.raises(ConfigError, match="lora.nf4_block_size=63"):
        nf4.check(replace(QLORA, nf4_block_size=63), "none")
    monkeypatch.setitem(sys.modules, nf4.AO_MODULE, None)  # as if torchao were not installed
    with pytest.raises(ConfigError, match=r"pip install 'llmtrain\[qlora\]'"):
        nf4.check(QLORA, "ddp")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    from helpers.procs import launch

    out = tmp_path_factory.mktemp("qlora") / "two_ranks.pt"
    proc = launch([SCRIPTS / "qlora_ranks.py", out], nproc=2, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_two_ranks_compute_what_one_process_computes(two_ranks, nf4_none, strategy):
    model, _, want = nf4_none
    got = two_ranks[strategy]
    assert got["weight_in_forward"] == "NF4Tensor"  # fsdp2 gathered the 4-bit pieces, not a dequantized copy
    for name, w in dequantized_base(model).items():  # the same 4-bit values as one process, bit for bit
        assert torch.equal(got["base"][name], w), name
    assert (got["logits"] - want["logits"]).abs().max() < 1e-5
    for name, g in want["grads"].items():
        assert (got["grads"][name] - g).abs().max() < 1e-5, name
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) < 1e-5


@pytest.mark.slow
def test_fsdp2_shards_that_do_not_divide_store_finer_scaler_groups(two_ranks):
    report = two_ranks["fsdp2"]["report"]
    # gate/up/down: 2816 blocks in 11 groups of 256; a rank's 1408 blocks are 5.5 of them: stored as 128s
    assert report["finer_groups"] == {f"model.layers.{i}.mlp.{m}_proj.base_layer.weight": 128
                                      for i in range(2) for m in ("gate", "up", "down")}
    assert report["weights"] == 14 and not report["skipped"]
    assert two_ranks["ddp"]["report"]["finer_groups"] == {}
    # per rank: half the fsdp2 weights' bytes (a few more fp32 factors), all of them under ddp
    assert 0.25 < report["nf4_bytes"] / report["bf16_bytes"] < 0.27
    assert abs(2 * report["bf16_bytes"] - two_ranks["ddp"]["report"]["bf16_bytes"]) == 0


@pytest.mark.slow
def test_fsdp2_rows_that_do_not_split_stay_full_precision_named(two_ranks):
    """gate/up of 705 rows cannot be split into equal 4-bit pieces over 2 ranks: kept (and named) on fsdp2, where
    none/ddp quantize them; down (256 x 705) splits, in groups of 2 scales (2820 blocks: groups of gcd 4)."""
    report = two_ranks["fsdp2_odd"]["report"]
    odd = {f"model.layers.{i}.mlp.{m}_proj.base_layer.weight" for i in range(2) for m in ("gate", "up")}
    assert set(report["skipped"]) == odd and report["weights"] == 10
    assert all("(705, 256) over 2 ranks are not whole rows" in why for why in report["skipped"].values())
    assert set(report["finer_groups"].values()) == {2}
    assert all(map(math.isfinite, two_ranks["fsdp2_odd"]["losses"]))


@pytest.mark.slow
def test_fsdp2_bf16_compute_on_the_nf4_base_runs(two_ranks):
    losses = two_ranks["fsdp2_bf16"]["losses"]
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[-1] < losses[0]


@pytest.mark.slow
def test_quantizing_after_loading_does_not_raise_the_host_peak(tmp_path):
    """One process each (ru_maxrss is per process): building the QLoRA model peaks no higher than building
    the LoRA one, and afterwards holds the bytes NF4 saved less."""
    from helpers.procs import finish, start

    seen, procs = {}, {mode: start([SCRIPTS / "qlora_memory.py", mode, tmp_path / f"{mode}.json"], torchrun=False)
                       for mode in ("none", "nf4")}  # side by side
    for mode, proc in procs.items():
        res = finish(proc, timeout=300)
        assert res.returncode == 0, res.stderr[-4000:]
        seen[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    saved = seen["nf4"]["base_bytes_fp32"] - seen["nf4"]["base_bytes_nf4"]
    assert seen["nf4"]["peak"] <= seen["none"]["peak"] + (4 << 20), seen
    assert seen["none"]["rss"] - seen["nf4"]["rss"] > 0.8 * saved, (seen, saved)


# --- Recipe level: recipes/finetune.py and recipes/dpo.py with lora.quantize_base=nf4 on the tiny saved base
# (tests/tiny.yaml's shape: 32 x 32, 16 x 32, 64 x 32 and 32 x 64 weights, all multiples of 64: every block
# linear is quantized, and its fsdp2 halves on 2 ranks too). One side-by-side launch serves the tests below.
TOL = 2e-5  # the parity tolerance of the LoRA tests
NF4 = "lora.quantize_base=nf4"
PAIRS = Path(__file__).resolve().parents[2] / "data" / "demo" / "preference.jsonl"
DPO_ARGS = ("data.format=preference", "train.max_steps=3", "dpo.loss=sigmoid", "dpo.beta=0.5")
BF16 = ("parallel.strategy=fsdp2", "parallel.mixed_precision=bf16", "lora.base_dtype=bf16",
        "train.micro_batch_size=2", "train.max_steps=8")


def qlora_args(base: Path, *extra: str) -> list[str]:
    return ["model.config=null", f"model.path={base}", "lora.enabled=true", "lora.r=4", "lora.alpha=8",
            "lora.dropout=0", "train.lr=1e-2", *extra]


def write_dequantized_base(base: Path, out: Path) -> None:
    """base with every weight a QLoRA run quantizes replaced by dequantize(quantize(W)) (nf4.round_trip)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from helpers import TINY
    from llmtrain.config import load_config
    from llmtrain.models.hf import load_model_config, load_tokenizer

    shutil.copytree(base, out)
    cfg = load_config(TINY, qlora_args(base, NF4))
    meta = lora.apply(build_meta_model(load_model_config(cfg.model, load_tokenizer(str(base), False)), cfg.model),
                      cfg.lora)
    weights = load_file(base / "model.safetensors")
    changed = nf4.round_trip(weights, meta, cfg.lora)
    assert sum(not torch.equal(changed[k], weights[k]) for k in weights) == 14  # 7 linears x 2 layers
    save_file({k: v.contiguous() for k, v in changed.items()}, out / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="session")
def qlora_runs(tmp_path_factory, base) -> dict[str, Path]:
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from helpers import REPO
    from helpers.procs import run_side_by_side

    root = tmp_path_factory.mktemp("qlora_runs")
    write_dequantized_base(base, root / "dequantized_base")
    # DPO starts from random adapters (B != 0), so that the policy differs from the reference at step 1; the
    # pairs are copied so that the precomputed reference log-probs start absent.
    torch.manual_seed(0)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                   PeftConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                              init_lora_weights=False)).save_pretrained(root / "dpo_init")
    pairs = root / "pairs.jsonl"
    pairs.write_text(PAIRS.read_text())
    dpo = (f"data.path={pairs}", f"lora.init_from={root / 'dpo_init'}", *DPO_ARGS)
    sft, dpo_script = REPO / "recipes" / "finetune.py", REPO / "recipes" / "dpo.py"
    runs = {  # name: (ranks, overrides, script); global batch 4 rows in each
        "none": (1, ("parallel.strategy=none", "checkpoint.every_steps=2", NF4), sft),
        "dequantized": (1, ("parallel.strategy=none",), sft),
        "ddp": (2, ("parallel.strategy=ddp", "train.micro_batch_size=1", "train.grad_accum_steps=2", NF4), sft),
        "fsdp2": (2, ("parallel.strategy=fsdp2", "train.micro_batch_size=2", "checkpoint.every_steps=2", NF4), sft),
        "fsdp2_1": (1, ("parallel.strategy=fsdp2", "train.micro_batch_size=1", "train.grad_accum_steps=4", NF4), sft),
        "hsdp": (2, ("parallel.strategy=fsdp2", "parallel.replicate=2", "train.micro_batch_size=2", NF4), sft),
        "bf16": (2, (*BF16, NF4), sft),
        "dpo": (1, ("parallel.strategy=none", *dpo, NF4), dpo_script),
        "dpo_pre": (1, ("parallel.strategy=none", *dpo, "dpo.precompute_reference=true", NF4), dpo_script),
        "dpo_dequantized": (1, ("parallel.strategy=none", *dpo), dpo_script),
    }
    results = run_side_by_side({name: (root / name, ranks, qlora_args(
        root / "dequantized_base" if "dequantized" in name else base, *extra), script)
        for name, (ranks, extra, script) in runs.items()}, at_once=4)
    for name, res in results.items():
        (root / name / "stdout.txt").write_text(res.stdout)
    return {name: root / name for name in runs} | {"dequantized_base": root / "dequantized_base"}


@pytest.mark.slow
def test_qlora_run_equals_lora_on_the_dequantized_base(qlora_runs):
    from helpers.procs import losses

    got, want = losses(qlora_runs["none"]), losses(qlora_runs["dequantized"])
    assert len(got) == 4 and got[-1] < got[0], got
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
    stdout = (qlora_runs["none"] / "stdout.txt").read_text()
    assert "nf4: 14 block linear weights" in stdout and "nf4:" not in (qlora_runs["dequantized"] / "stdout.txt"
                                                                        ).read_text()


@pytest.mark.slow
def test_qlora_losses_match_across_strategies_ranks_and_accumulation(qlora_runs):
    from helpers.procs import losses

    ref = losses(qlora_runs["none"])
    for name in ("ddp", "fsdp2", "fsdp2_1", "hsdp"):  # fsdp2_1, hsdp: shard groups of one rank
        assert losses(qlora_runs[name]) == pytest.approx(ref, abs=TOL), name


@pytest.mark.slow
def test_qlora_resumes_exactly_on_another_world_size_and_refuses_other_quantization(tmp_path, qlora_runs, base):
    """fsdp2 on 2 ranks at step 2 -> one process (none): steps 3-4 as uninterrupted. The same checkpoint
    resumed as plain LoRA, or with another block size: exit 2 naming the key."""
    import shutil

    from helpers.procs import finish_recipe, losses_by_step, start_recipe

    ckpt = qlora_runs["fsdp2"] / "checkpoints" / "step_2"
    cases = {"resume": (NF4,), "lora": (), "block": (NF4, "lora.nf4_block_size=32")}
    procs = {}
    for name, extra in cases.items():
        out = tmp_path / name
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(ckpt, out / "checkpoints" / "step_2")
        procs[name] = start_recipe(out, *qlora_args(base, "parallel.strategy=none", *extra))
    results = {name: finish_recipe(proc, check=name == "resume") for name, proc in procs.items()}
    assert "resumed at step 2" in results["resume"].stdout
    full, got = losses_by_step(qlora_runs["fsdp2"]), losses_by_step(tmp_path / "resume")
    assert [got[s] for s in (3, 4)] == pytest.approx([full[3], full[4]], abs=TOL)
    for name, key in (("lora", "lora.quantize_base: 'nf4' -> 'none'"), ("block", "lora.nf4_block_size: 64 -> 32")):
        res = results[name]
        assert res.returncode == 2 and key in res.stderr, (name, res.stderr[-2000:])


@pytest.mark.slow
def test_qlora_refuses_fsdp1_in_one_line(tmp_path, base, run_setup):
    from helpers import RECIPE, TINY

    code, _, err = run_setup(RECIPE, "--config", TINY, f"output_dir={tmp_path}",
                             *qlora_args(base, NF4, "parallel.strategy=fsdp"))
    errors = [line for line in err.splitlines() if "quantize_base" in line]
    assert code == 2 and len(errors) == 1 and "parallel.strategy=fsdp2" in errors[0], err[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_qlora_exports_load_generate_and_equal_the_converter(tmp_path, qlora_runs, base):
    """adapter/ loads with PEFT onto the original (unquantized) base, hf/ (merged onto the dequantized base)
    with from_pretrained; both generate. The merged export is that of LoRA on the dequantized base (the same
    adapters), and `python -m llmtrain.convert` of the last checkpoint writes it again (<= 1e-6)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from helpers.procs import launch
    from llmtrain.models.hf import load_tokenizer

    run = qlora_runs["none"]
    res = launch(["-m", "llmtrain.convert", run / "checkpoints" / "step_4", tmp_path], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    merged, converted = load_file(run / "hf" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    twin = load_file(qlora_runs["dequantized"] / "hf" / "model.safetensors")
    original = load_file(base / "model.safetensors")
    assert merged.keys() == converted.keys() == twin.keys() == original.keys()
    for key, tensor in merged.items():
        assert tensor.dtype == original[key].dtype, key  # checkpoint.export_dtype: fp32 (the default)
        assert (converted[key] - tensor).abs().max() <= 1e-6, key
        assert (twin[key] - tensor).abs().max() < 1e-5, key
    tokenizer = load_tokenizer(str(base), False)
    ids = torch.tensor([tokenizer.encode("The quick brown fox")])
    with torch.no_grad():
        models = {"adapter": PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / "adapter"),
                  "hf": AutoModelForCausalLM.from_pretrained(run / "hf")}
        for name, model in models.items():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, pad_token_id=tokenizer.eos_token_id)
            assert out.shape[1] > ids.shape[1] and tokenizer.decode(out[0, ids.shape[1]:]), name
        # the adapter on the original base is the QLoRA model up to the quantization error of the base
        logits = {name: m(input_ids=ids).logits for name, m in models.items()}
        assert 0 < (logits["adapter"] - logits["hf"]).abs().max() < 1.0


@pytest.mark.slow
def test_qlora_dpo_reference_is_the_quantized_base_and_precomputes(qlora_runs):
    """DPO's reference is the policy's quantized base with the adapters off: the losses of DPO with LoRA on the
    dequantized base; with dpo.precompute_reference=true, those of the live reference."""
    from helpers.procs import losses

    live = losses(qlora_runs["dpo"])
    assert len(live) == 3 and all(map(math.isfinite, live))
    assert live == pytest.approx(losses(qlora_runs["dpo_dequantized"]), abs=1e-5)
    assert losses(qlora_runs["dpo_pre"]) == pytest.approx(live, abs=TOL)
    # computed here, not reused: the cache key includes the quantization (train/build.base_identity)
    assert "reference log-probs: computed 1000 pairs" in (qlora_runs["dpo_pre"] / "stdout.txt").read_text()


@pytest.mark.slow
def test_qlora_bf16_compute_on_fsdp2_learns_the_demo(qlora_runs):
    from helpers.procs import losses

    got = losses(qlora_runs["bf16"])
    assert len(got) == 8 and all(map(math.isfinite, got)) and sum(got[-2:]) < sum(got[:2]), got
    assert "base bf16" in (qlora_runs["bf16"] / "stdout.txt").read_text()


def test_a_quantized_input_model_is_refused_naming_the_problem(tmp_path):
    """A bitsandbytes (or any pre-quantized) checkpoint as model.path: refused at set-up, pointing at the
    original weights and lora.quantize_base=nf4."""
    from llmtrain.models.hf import check_paths

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                      "bnb_4bit_quant_type": "nf4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"model.path: .* is quantized \(config.json quantization_config: "
                                          r"bitsandbytes\).*lora.quantize_base=nf4"):
        check_paths(ModelConfig(path=str(tmp_path)), None)
