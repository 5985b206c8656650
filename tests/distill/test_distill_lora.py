"""LoRA and QLoRA students of recipes/distill.py (test_distill's teacher, the tiny reference run's export, and its
KD settings; the student a saved 1-layer base of test_distill's inline shape and init, adapters r 4 on it):
with LoRA (lora.dropout at its default, keyed) 1 process and 2 ranks (ddp, fsdp2 with accumulation) log the
same losses and eval metrics; the teacher is untouched (its files, its val_teacher_loss at every eval, nothing
of it in the checkpoint, whose model and optimizer state are the student's adapters only); a run resumed from a
2-rank checkpoint on 1 process continues exactly; the exported adapter/ on the student base (PEFT) gives the
merged export's logits, 2-rank export against 1-process baseline. With QLoRA (lora.quantize_base=nf4, every
block linear of the student quantized) 1 process and 2 fsdp2 ranks with accumulation log the same falling
losses, a run resumed from the 2-rank checkpoint on 1 process continues exactly, and the 2-rank merged export
gives the 1-process one's logits, its adapter/ loading with PEFT on the student base."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import REPO
from helpers.distill import DISTILL, KD, STUDENT
from helpers.export import assert_export_matches, save_baseline
from helpers.procs import losses_by_step, read_metrics, run_recipe, run_side_by_side
from llmtrain.models import names

TOL = 2e-5  # test_distill's, test_lora's and test_qlora's
VAL_ROWS = 10
FSDP2_ACCUM = ("parallel.strategy=fsdp2", "train.micro_batch_size=1", "train.grad_accum_steps=2")
RUNS = {  # name: (ranks, overrides); global batch 4 rows in each
    "none": (1, ("parallel.strategy=none",)),
    "ddp": (2, ("parallel.strategy=ddp", "train.micro_batch_size=2", "checkpoint.every_steps=2")),
    "fsdp2": (2, FSDP2_ACCUM),
    "qlora_none": (1, ("parallel.strategy=none", "lora.quantize_base=nf4")),
    "qlora_fsdp2": (2, (*FSDP2_ACCUM, "lora.quantize_base=nf4", "checkpoint.every_steps=2")),
}
EVALS = ("none", "fsdp2")  # with eval.every_steps=2 on the validation rows


def student_base(teacher: Path, out: Path) -> Path:
    """test_distill's inline student (STUDENT: hidden 16, 1 layer, initializer_range 0.5, far from the teacher)
    saved as a Hugging Face directory with the teacher's tokenizer, for LoRA's model.path."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(teacher)
    config.update({k.removeprefix("model.config."): float(v) if "." in v else int(v)
                   for k, v in (s.split("=") for s in STUDENT)})
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(teacher).save_pretrained(out)
    return out


def lora_args(teacher: Path, student: Path, *extra: str) -> list[str]:
    """test_distill's run on a LoRA student (lora.dropout: its default, 0.05, keyed)."""
    return [f"distill.teacher_path={teacher}", "data.packing=false", *KD, "model.config=null",
            f"model.path={student}", "lora.enabled=true", "lora.r=4", "lora.alpha=8", "train.lr=1e-2", *extra]


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill-lora")
    student = student_base(base, root / "student")
    val = root / "val.jsonl"
    val.write_text("".join((REPO / "data" / "demo" / "val.jsonl").read_text().splitlines(keepends=True)[:VAL_ROWS]))
    teacher_files = digest(base)
    results = run_side_by_side({name: (root / name, ranks, lora_args(base, student, *extra, *(
        (f"data.val_path={val}", "eval.every_steps=2") if name in EVALS else ())), DISTILL)
        for name, (ranks, extra) in RUNS.items()}, at_once=2)
    for name, res in results.items():
        (root / name / "stdout.log").write_text(res.stdout)
    assert digest(base) == teacher_files  # the teacher's directory, file for file
    return {name: root / name for name in RUNS} | {"student": student, "val": val}


def evals(output_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(output_dir) if "val_loss" in r}


@pytest.mark.slow
def test_lora_student_losses_match_across_ranks_strategies_and_accumulation(runs):
    want = losses_by_step(runs["none"])
    assert sorted(want) == [1, 2, 3, 4] and want[4] < want[1], want
    kd = {r["step"]: r["kd_loss"] for r in read_metrics(runs["none"]) if "loss" in r}
    for name in ("ddp", "fsdp2"):
        assert losses_by_step(runs[name]) == pytest.approx(want, abs=TOL), name
        got = {r["step"]: r["kd_loss"] for r in read_metrics(runs[name]) if "loss" in r}
        assert got == pytest.approx(kd, rel=1e-5), name  # KD ~ 3e-3 (top-8 JSD): to its own precision
    got, want = evals(runs["fsdp2"]), evals(runs["none"])
    assert sorted(want) == sorted(got) == [2, 4]
    for step in (2, 4):
        for key in ("val_loss", "val_kd_loss", "val_teacher_loss"):
            assert got[step][key] == pytest.approx(want[step][key], abs=TOL), (step, key)
    stdout = (runs["none"] / "stdout.log").read_text()
    assert "lora: trainable" in stdout and "distill: teacher" in stdout, stdout[-3000:]


@pytest.mark.slow
def test_lora_student_leaves_the_teacher_untouched(runs):
    """The teacher's files are checked by the fixture; here: its loss on the validation rows is the same at
    every eval (not trained in memory either), the student's falls, and the checkpoint's model and optimizer
    state are the student's adapters only (no teacher, no frozen base weight)."""
    for name in EVALS:
        records = evals(runs[name])
        assert records[2]["val_teacher_loss"] == records[4]["val_teacher_loss"], name
        assert records[4]["val_kd_loss"] < records[2]["val_kd_loss"], name
    saved = dcp.FileSystemReader(str(runs["ddp"] / "checkpoints" / "step_2")).read_metadata().state_dict_metadata
    trained = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    optimized = {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in saved if k.startswith("optim.state.")}
    assert len(trained) == 2 * 7 and all(names.is_adapter(k) for k in trained), sorted(trained)
    assert optimized == trained, sorted(optimized ^ trained)[:4]


@pytest.mark.slow
def test_lora_student_resumes_exactly_from_two_ranks_on_one_process(tmp_path, runs, base):
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(runs["ddp"] / "checkpoints" / "step_2", out / "checkpoints" / "step_2")
    res = run_recipe(out, *lora_args(base, runs["student"], "parallel.strategy=none"), script=DISTILL)
    assert "resumed at step 2" in res.stdout
    got, want = losses_by_step(out), losses_by_step(runs["ddp"])
    assert sorted(got) == [3, 4] and [got[s] for s in (3, 4)] == pytest.approx([want[3], want[4]], abs=TOL)


@pytest.mark.slow
def test_lora_student_adapter_loads_with_peft_on_the_student_base(runs):
    """adapter/ (adapter_config.json, adapter_model.safetensors) of the 2-rank fsdp2 run on the student base
    through PeftModel.from_pretrained, and its merged hf/, give the 1-process run's merged logits."""
    adapter = runs["fsdp2"] / "adapter"
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert_export_matches(runs["fsdp2"], save_baseline(runs["none"]), lora_base=runs["student"])


@pytest.mark.slow
def test_qlora_student_losses_match_on_one_process_and_two_fsdp2_ranks(runs):
    want = losses_by_step(runs["qlora_none"])
    assert sorted(want) == [1, 2, 3, 4] and want[4] < want[1], want
    assert losses_by_step(runs["qlora_fsdp2"]) == pytest.approx(want, abs=TOL)
    for name in ("qlora_none", "qlora_fsdp2"):
        stdout = (runs[name] / "stdout.log").read_text()
        assert "nf4: 7 block linear weights" in stdout and "full precision:" not in stdout, stdout[-3000:]
    # the 4-bit base is not the LoRA runs' fp32 one: step 1 (the base alone, B = 0) differs
    assert abs(want[1] - losses_by_step(runs["none"])[1]) > 1e-4


@pytest.mark.slow
def test_qlora_student_resumes_exactly_on_one_process_and_exports_as_one_process_does(tmp_path, runs, base):
    """From step 2 of the 2-rank fsdp2 QLoRA run, on 1 process: steps 3-4 as uninterrupted. Its merged export
    (LoRA merged onto the dequantized base) gives the 1-process run's logits; adapter/ loads with PEFT onto the
    student base and differs from the merged export by the base's quantization error alone: on the 7 quantized
    block linears, the same for the 1-process and the 2-rank run."""
    from safetensors.torch import load_file

    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(runs["qlora_fsdp2"] / "checkpoints" / "step_2", out / "checkpoints" / "step_2")
    res = run_recipe(out, *lora_args(base, runs["student"], "parallel.strategy=none", "lora.quantize_base=nf4"),
                     script=DISTILL)
    assert "resumed at step 2" in res.stdout
    got, want = losses_by_step(out), losses_by_step(runs["qlora_fsdp2"])
    assert sorted(got) == [3, 4] and [got[s] for s in (3, 4)] == pytest.approx([want[3], want[4]], abs=TOL)
    assert_export_matches(runs["qlora_fsdp2"], save_baseline(runs["qlora_none"]))
    gaps = [quantization_gap(runs[name], runs["student"]) for name in ("qlora_none", "qlora_fsdp2")]
    assert sorted(gaps[0]) == sorted(gaps[1]) and len(gaps[0]) == 7, sorted(gaps[0])
    original = load_file(runs["student"] / "model.safetensors")
    for key, gap in gaps[0].items():
        assert (gaps[1][key] - gap).abs().max() < 1e-6, key
        # original + gap is the dequantized base: each block of 64 (lora.nf4_block_size) at most NF4's 16 levels x
        # the block's scale (the original's blocks: 64 distinct values), which adapters missing from adapter/ break
        assert max(levels(original[key] + gap)) <= 16 < min(levels(original[key])), key


def levels(weight: torch.Tensor) -> list[int]:
    """The distinct values of each block of 64, relative to the block's largest: values within 1e-3 of each other
    count once (NF4's closest levels are 0.08 apart; float rounding of a merge moves a value ~1e-7)."""
    blocks = weight.flatten().view(-1, 64)
    ordered = (blocks / blocks.abs().amax(1, keepdim=True)).sort(1).values
    return (1 + (ordered.diff(dim=1) > 1e-3).sum(1)).tolist()


def quantization_gap(run: Path, student: Path) -> dict[str, torch.Tensor]:
    """{name: merged export - adapter/ merged by PEFT onto the student base} where they differ: the export merges
    the adapters onto the dequantized NF4 base, PEFT onto the original, so they differ by the base's quantization
    error on the quantized block linears (whatever the adapters) and nowhere else (to 1e-6)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    exported = load_file(run / "hf" / "model.safetensors")
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(student), run / "adapter")
    merged = {k: v.detach() for k, v in peft.merge_and_unload().state_dict().items()}
    assert exported.keys() <= merged.keys(), sorted(exported.keys() - merged.keys())  # a tied lm_head saved once
    gaps = {k: exported[k] - merged[k] for k in exported}
    return {k: gap for k, gap in gaps.items() if gap.abs().max() > 1e-6}
