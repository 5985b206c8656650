"""Vision-language SFT (docs/vision.md): chat data with images rendered by the model's processor, LLaVA and
Qwen2.5-VL loaded as from_pretrained loads them, the same losses on every strategy and split, a frozen vision
tower, the export with its processor."""

from __future__ import annotations

import collections
import functools
import json
import typing
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers.procs import finish_recipe, losses_by_step, read_metrics, start_recipe
from helpers.vision import TRUST_REMOTE_CODE, make_images_data, make_vlm
from llmtrain.config import ConfigError, DataConfig
from llmtrain.data import vision as vision_data
from llmtrain.data.formats import IGNORE, MODEL_INPUT, model_inputs
from llmtrain.data.sampling import GlobalOrderSampler
from llmtrain.losses.token import token_loss_sum
from llmtrain.models.vision import FAMILIES as VISION_FAMILIES

FAMILIES = ["llava", "qwen2_5_vl", "gemma3", "idefics3"]
SEED, STEPS, GLOBAL = 7, 3, 4
RUN = """\
data:
  path: {data}
  val_path: {data}
  format: chat
  seq_len: 128
  packing: false
parallel:
  strategy: none
train:
  max_steps: {steps}
  micro_batch_size: 2
  grad_accum_steps: 2
  lr: 1.0e-3
  warmup_steps: 1
  weight_decay: 0.1
  seed: {seed}
eval:
  every_steps: {steps}
checkpoint:
  every_steps: 2
log:
  every_steps: 1
  progress: false
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vision")
    for family in FAMILIES:
        make_vlm(family, root / family)
    make_images_data(root / "data")
    return root


@functools.cache
def processor(assets: Path, family: str):
    return vision_data.load_processor(str(assets / family), TRUST_REMOTE_CODE[family], None)


def records(assets: Path) -> list[dict]:
    return [json.loads(line) for line in (assets / "data" / "train.jsonl").read_text().splitlines()]


@functools.cache
def encoded(assets: Path, family: str) -> list[dict]:
    proc, section = processor(assets, family), DataConfig(seq_len=128)
    return [vision_data.encode(r, section, proc, str(assets / "data")) for r in records(assets)]


def test_freeze_choices_are_the_parts():
    """model.freeze's choices (config.py repeats them: it imports nothing of llmtrain) are the registry's parts."""
    from llmtrain.config import ModelConfig
    from llmtrain.models import vision

    (choices,) = typing.get_args(typing.get_type_hints(ModelConfig)["freeze"])
    assert typing.get_args(choices) == vision.PART_NAMES


@pytest.mark.parametrize("family", FAMILIES)
def test_labels_are_the_assistant_tokens_only(assets, family):
    """Token by token: the trained tokens are exactly the answer and its end-of-turn token, at the end of the
    assistant's turn; image tokens, the prompt and the template's markers are not."""
    proc = processor(assets, family)
    tok = proc.tokenizer
    for record, example in zip(records(assets), encoded(assets, family)):
        answer = record["messages"][1]["content"][0]["text"]
        want = tok(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids, labels = example["input_ids"], example["labels"]
        trained = [i for i, label in enumerate(labels) if label != IGNORE]
        assert [ids[i] for i in trained] == want and [labels[i] for i in trained] == want
        assert trained == list(range(len(ids) - len(want) - 1, len(ids) - 1))  # then the turn's "\n"
        assert proc.image_token_id in ids and all(labels[i] == IGNORE for i, t in enumerate(ids)
                                                  if t == proc.image_token_id)


@pytest.mark.parametrize("family", FAMILIES)
def test_collate_renders_the_stored_rows_and_passes_every_tensor(assets, family):
    """A micro-batch rendered from the rows (images opened then) has the ids and labels the rows stored, padded
    right and never trained; every tensor the processor returns is a model input (Qwen's mm_token_type_ids)."""
    proc, rows = processor(assets, family), encoded(assets, family)[:3]
    batch = vision_data.collate(rows, proc)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch["input_ids"][i, :n].tolist() == row["input_ids"]
        assert batch["labels"][i, :n].tolist() == row["labels"] and (batch["labels"][i, n:] == IGNORE).all()
    direct = proc.apply_chat_template([json.loads(r["messages_json"]) for r in rows], tokenize=True, return_dict=True,
                                      processor_kwargs={"images": [[vision_data._open(p) for p in r["images"]]
                                                                   for r in rows], "padding": True})
    assert set(model_inputs(batch)) == set(direct) and {"pixel_values", "attention_mask"} <= set(direct)
    if family == "qwen2_5_vl":
        assert MODEL_INPUT + "mm_token_type_ids" in batch and MODEL_INPUT + "image_grid_thw" in batch


def test_bad_images_are_named(assets, tmp_path):
    """A missing image, an unreadable one and a placeholder count that does not match: one line each."""
    proc, section = processor(assets, "llava"), DataConfig(seq_len=128)
    (tmp_path / "bad.png").write_text("not an image")
    user = [{"type": "image"}, {"type": "text", "text": "Colour?"}]
    answer = {"role": "assistant", "content": "red"}
    cases = {"image gone.png: no such file": {"images": ["gone.png"]},
             "image bad.png: cannot be read": {"images": ["bad.png"]},
             "1 image placeholders but 2 images": {"images": ["bad.png", "bad.png"]}}
    for message, extra in cases.items():
        with pytest.raises(vision_data.BadRecord, match=message):
            vision_data.encode({"messages": [{"role": "user", "content": user}, answer], **extra}, section, proc,
                               str(tmp_path))
    with pytest.raises(vision_data.BadRecord, match="longer than data.seq_len=8"):
        vision_data.encode(records(assets)[0], DataConfig(seq_len=8), proc, str(assets / "data"))


def test_image_data_for_a_text_only_model_is_a_bad_record_saying_so(assets):
    from llmtrain.data.formats import encode_chat

    tok = processor(assets, "llava").tokenizer
    with pytest.raises(vision_data.BadRecord, match="list of parts \\(images\\): model.path is a text-only model"):
        encode_chat(records(assets)[0], DataConfig(format="chat"), tok)


def test_packing_and_a_sequence_split_are_refused_in_one_line(assets):
    from llmtrain.config import ModelConfig

    llava = ModelConfig(path=str(assets / "llava"))
    with pytest.raises(ConfigError, match="data.packing: rows with images are padded, not packed"):
        vision_data.check(DataConfig(format="chat", packing=True), llava, 1)
    with pytest.raises(ConfigError, match="parallel.sp_size=2: sequence parallelism splits text rows only"):
        vision_data.check(DataConfig(format="chat", packing=False), llava, 2)


SPLITS = {  # name -> (ranks, overrides): the global batch of 4 split every way
    "none": (1, ["parallel.strategy=none"]),
    "ddp": (2, ["parallel.strategy=ddp", "train.grad_accum_steps=1"]),
    "fsdp2": (2, ["parallel.strategy=fsdp2", "train.micro_batch_size=1"]),
    "fsdp": (2, ["parallel.strategy=fsdp", "train.grad_accum_steps=1"]),
}


# LoRA (model.freeze's default: adapters on the projector and the language model) and QLoRA (an NF4 language
# model) on 2 fsdp2 ranks, both exports.
ADAPTERS = {
    ("qwen2_5_vl", "lora"): (2, ["parallel.strategy=fsdp2", "train.micro_batch_size=1", "lora.enabled=true",
                                 "lora.export=both"]),
    ("llava", "qlora"): (2, ["parallel.strategy=fsdp2", "train.micro_batch_size=1", "lora.enabled=true",
                             "lora.export=both", "lora.quantize_base=nf4"]),
    ("gemma3", "qlora"): (2, ["parallel.strategy=fsdp2", "train.micro_batch_size=1", "lora.enabled=true",
                              "lora.export=both", "lora.quantize_base=nf4"]),
    ("idefics3", "lora"): (2, ["parallel.strategy=fsdp2", "train.micro_batch_size=1", "lora.enabled=true",
                               "lora.export=both"]),
}


@pytest.fixture(scope="module")
def runs(assets) -> dict[tuple[str, str], Path]:
    """Every family x split, and ADAPTERS' runs, two at a time."""
    config = assets / "run.yaml"
    config.write_text(RUN.format(data=assets / "data" / "train.jsonl", steps=STEPS, seed=SEED))
    jobs = {**{(family, split): run for family in FAMILIES for split, run in SPLITS.items()}, **ADAPTERS}
    out, running = {}, []
    for (family, split), (nproc, overrides) in jobs.items():
        if len(running) == 2:
            finish_recipe(running.pop(0))
        out[family, split] = assets / "runs" / f"{family}-{split}"
        running.append(start_recipe(out[family, split], f"model.path={assets / family}",
                                    f"model.trust_remote_code={str(TRUST_REMOTE_CODE[family]).lower()}",
                                    *overrides, nproc=nproc, config=config))
    for proc in running:
        finish_recipe(proc)
    return out


def _loss(model, batch) -> tuple[float, int]:
    """(summed token loss, trained tokens) of a micro-batch."""
    with torch.no_grad():
        logits = model(**model_inputs(batch), use_cache=False).logits
    return float(token_loss_sum(logits, batch["labels"])), int((batch["labels"][:, 1:] != IGNORE).sum())


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_losses_match_from_pretrained_and_every_split(assets, runs, family):
    """Step 1's loss is from_pretrained's on the step's global batch (the loaded weights are its); the losses of
    1 vs 2 ranks x none/ddp/fsdp2/fsdp x accumulation agree to 1e-5."""
    def losses(out: Path) -> list[float]:
        return [loss for _, loss in sorted(losses_by_step(out).items())]

    reference = losses(runs[family, "none"])
    assert len(reference) == STEPS and reference[-1] < reference[0]
    for split in SPLITS:
        assert losses(runs[family, split]) == pytest.approx(reference, abs=1e-5), split
    rows = encoded(assets, family)
    first = [i for i, _ in zip(GlobalOrderSampler(rows, 1, 0, SEED), range(GLOBAL))]  # step 1's rows
    model = AutoModelForImageTextToText.from_pretrained(assets / family, dtype=torch.float32)
    loss, n = _loss(model, vision_data.collate([rows[i] for i in first], processor(assets, family)))
    assert loss / n == pytest.approx(reference[0], abs=1e-5)


@pytest.mark.slow
def test_resume_two_ranks_to_one_is_exact(assets, runs):
    """fsdp2 on 2 ranks checkpointed at step 2, resumed by 1 process without a wrapper: step 3's loss and the
    export are the uninterrupted run's."""
    out, running = {}, []
    for family in FAMILIES:
        out[family] = assets / "runs" / f"{family}-resumed"
        running.append(start_recipe(out[family], f"model.path={assets / family}",
                                    f"model.trust_remote_code={str(TRUST_REMOTE_CODE[family]).lower()}",
                                    f"checkpoint.resume={runs[family, 'fsdp2'] / 'checkpoints' / 'step_2'}",
                                    "eval.every_steps=0", config=assets / "run.yaml"))
    for proc in running:
        finish_recipe(proc)
    for family in FAMILIES:
        assert list(losses_by_step(out[family])) == [3]
        assert losses_by_step(out[family])[3] == pytest.approx(losses_by_step(runs[family, "none"])[3], abs=1e-5)
        resumed = AutoModelForImageTextToText.from_pretrained(out[family] / "hf", dtype=torch.float32)
        reference = dict(AutoModelForImageTextToText.from_pretrained(runs[family, "none"] / "hf").named_parameters())
        for name, p in resumed.named_parameters():
            torch.testing.assert_close(p, reference[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_frozen_tower_and_export(assets, runs, family):
    """The export loads with AutoModelForImageTextToText + AutoProcessor and gives the trained model's validation
    loss; its vision tower is bit-identical to the original (frozen by default) while the rest changed."""
    from llmtrain.models import vision

    for split in ("fsdp2",):  # the sharded gather; the unwrapped run's export is the resumed one's reference
        export = runs[family, split] / "hf"
        trained = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
        original = AutoModelForImageTextToText.from_pretrained(assets / family, dtype=torch.float32)
        tower = vision.part_params(trained, "vision_tower")
        before = dict(original.named_parameters())
        for name, p in trained.named_parameters():
            assert torch.equal(p, before[name]) == (id(p) in tower), (split, name)
        proc = AutoProcessor.from_pretrained(export, trust_remote_code=TRUST_REMOTE_CODE[family])
        assert proc.chat_template == processor(assets, family).chat_template
        rows = encoded(assets, family)
        sums = [_loss(trained, vision_data.collate(rows[i:i + 2], proc)) for i in range(0, len(rows), 2)]
        val = [r["val_loss"] for r in read_metrics(runs[family, split]) if "val_loss" in r][-1]
        assert sum(s for s, _ in sums) / sum(n for _, n in sums) == pytest.approx(val, abs=1e-5), split


@pytest.mark.slow
@pytest.mark.parametrize("family, split", [("llava", "fsdp2"), ("qwen2_5_vl", "fsdp2"), ("llava", "qlora")])
def test_convert_writes_the_runs_export_with_its_processor(assets, runs, tmp_path, family, split):
    """`python -m llmtrain.convert` of the last checkpoint, which holds the trained weights only (the frozen
    vision tower, or QLoRA's base, come from the run's model.path), writes the run's own exports: the same
    tensors and the processor files (Qwen's processor code included), loaded by AutoProcessor."""
    from safetensors.torch import load_file

    from llmtrain import convert

    run = runs[family, split]
    assert convert.main([str(run / "checkpoints" / f"step_{STEPS}"), str(tmp_path / "out")]) == 0
    # OUT is the export itself, or a LoRA run's adapter/ and hf/ beside each other as in output_dir
    files = ["adapter/adapter_model.safetensors", "hf/model.safetensors"] if split == "qlora" else ["model.safetensors"]
    for name in files:
        written, exported = load_file(tmp_path / "out" / name), load_file(run / ("" if "/" in name else "hf") / name)
        assert written.keys() == exported.keys(), name
        for key, tensor in exported.items():
            torch.testing.assert_close(written[key], tensor, rtol=0, atol=1e-6, msg=key)
    want = processor(assets, family)
    proc = AutoProcessor.from_pretrained(tmp_path / "out" / Path(files[-1]).parent,
                                         trust_remote_code=TRUST_REMOTE_CODE[family])
    assert type(proc).__name__ == type(want).__name__ and proc.chat_template == want.chat_template
    assert proc.image_processor.to_dict() == want.image_processor.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("family, kind", ADAPTERS)
def test_adapters_load_on_the_base_with_peft_and_give_the_merged_export(assets, runs, family, kind):
    """adapter/ (PEFT) loaded on the original base gives the merged hf/ export's logits on a batch with images
    (QLoRA: on the base as its NF4 round trip, what the adapters trained on); the adapters sit on the projector
    (where it has linear layers) and the language model only, the vision tower of hf/ is the original's bit for
    bit, and (QLoRA) only the language model's block linears were quantized. LoRA and QLoRA on every family."""
    from peft import PeftModel

    from llmtrain.config import load_config
    from llmtrain.models import lora, nf4, vision
    from llmtrain.models.hf import build_meta_model

    run = runs[family, kind]
    assert losses_by_step(run)[STEPS] < losses_by_step(run)[1]
    merged = AutoModelForImageTextToText.from_pretrained(run / "hf", dtype=torch.float32).eval()
    base = AutoModelForImageTextToText.from_pretrained(assets / family, dtype=torch.float32)
    original = base.state_dict()
    adapted = json.loads((run / "adapter" / "adapter_config.json").read_text())["target_modules"]
    p = vision.parts(base)
    # on the projector where it has linear layers (Gemma 3's is a bare weight matrix, which LoRA cannot adapt)
    linear = any(isinstance(m, torch.nn.Linear) for n, m in base.named_modules() if n.startswith(p.projector))
    assert any(m.startswith(p.projector) for m in adapted) == linear
    assert any(m.startswith(p.language) for m in adapted)
    assert not any(m.startswith(p.tower) and not m.startswith(p.projector) for m in adapted)
    if kind == "qlora":
        cfg = load_config(run / "config.yaml")
        rounded = nf4.round_trip(original, lora.apply(build_meta_model(base.config, cfg.model), cfg.lora,
                                                      cfg.model.freeze), cfg.lora)
        changed = {k for k in original if not torch.equal(rounded[k], original[k])}
        assert changed and all(k.startswith(p.layers) for k in changed), sorted(changed)
        base.load_state_dict(rounded)
    tower = vision.part_params(merged, "vision_tower")
    for name, q in merged.named_parameters():
        if id(q) in tower:
            assert torch.equal(q, original[name]), name
    adapter = PeftModel.from_pretrained(base, run / "adapter").eval()
    batch = model_inputs(vision_data.collate(encoded(assets, family)[:4], processor(assets, family)))
    with torch.no_grad():
        torch.testing.assert_close(adapter(**batch).logits, merged(**batch).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_image_matches_transformers(assets, family, capsys):
    """`python -m llmtrain.tools.generate --image` prints transformers' greedy answer about the image; a text-only
    model or a missing image is one line, exit 2."""
    from llmtrain.tools import generate

    model_dir, image = assets / family, assets / "data" / "images" / "0.png"
    args = ["--model", str(model_dir), "--image", str(image), "--prompt", "What colour is it?", "--max-new-tokens", "6"]
    assert generate.main(args + (["--trust-remote-code"] if TRUST_REMOTE_CODE[family] else [])) == 0
    printed = capsys.readouterr().out.strip()
    proc = processor(assets, family)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    inputs = proc.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True,
                                      processor_kwargs={"images": [vision_data._open(str(image))],
                                                        "return_tensors": "pt"})
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False,
                         eos_token_id=generate.stop_token_ids(model, proc.tokenizer))
    assert printed == proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert generate.main(["--model", str(model_dir), "--image", "gone.png", "--prompt", "x"]) == 2
    assert "--image gone.png: no such file" in capsys.readouterr().err


@pytest.mark.parametrize("family", sorted(VISION_FAMILIES))
def test_registry_names_modules_of_each_family(family):
    """Every FAMILIES entry names modules its transformers class has (SmolVLM, whose processor needs torchvision,
    is Idefics3's layout under its own model_type: checked here on its meta model only)."""
    from accelerate import init_empty_weights
    from transformers import SmolVLMConfig

    from helpers.vision import FAMILIES as MAKERS
    from llmtrain.models import vision

    if family == "smolvlm":
        tiny = MAKERS["idefics3"](None)[0].to_dict()
        config = SmolVLMConfig(text_config=tiny["text_config"], vision_config=tiny["vision_config"], scale_factor=2)
    else:
        config = MAKERS[family](None)[0]
    with init_empty_weights():
        model = AutoModelForImageTextToText.from_config(config)
    assert vision.is_vision(model.config) and model.config.model_type == family
    p = vision.parts(model)
    for path in (p.tower, p.projector, p.language, p.blocks, p.layers):
        model.get_submodule(path)
    units = vision.wrap_units(model)
    assert len({id(m) for m in units}) == len(units)
    every = {id(q) for q in model.parameters()}
    parts = [vision.part_params(model, part) for part in vision.PART_NAMES]
    assert set().union(*parts) == every and sum(map(len, parts)) == len(every)  # the parts cover it, once each


def _counted(forward, calls: collections.Counter, key: int, *args, **kwargs):
    calls.update([key])
    return forward(*args, **kwargs)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])  # the others' blocks are the same transformers layers
def test_activation_checkpointing_recomputes_both_towers_with_the_same_loss_and_grads(assets, family):
    """parallel.activation_checkpointing (as parallelize applies it) on a model training all its parts: every
    block of the vision tower and of the language model runs again in backward, and the loss and every gradient
    (the vision blocks' included) are those of the model without it."""
    from llmtrain import parallelize
    from llmtrain.models import vision

    batch = vision_data.collate(encoded(assets, family)[:2], processor(assets, family))
    results = {}
    for checkpointed in (False, True):
        model = AutoModelForImageTextToText.from_pretrained(assets / family, dtype=torch.float32).train()
        if checkpointed:
            parallelize.apply_activation_checkpointing(model)
        towers = {"vision": list(model.get_submodule(vision.parts(model).blocks)),
                  "language": vision.language_layers(model)}
        calls = collections.Counter()
        for block in [*towers["vision"], *towers["language"]]:  # counted inside: a recompute runs no module hooks
            block.mlp.forward = functools.partial(_counted, block.mlp.forward, calls, id(block.mlp))
        loss = token_loss_sum(model(**model_inputs(batch), use_cache=False).logits, batch["labels"])
        loss.backward()
        assert all(q.grad is not None for block in towers["vision"] for q in block.parameters())
        results[checkpointed] = (loss.detach(), {n: q.grad for n, q in model.named_parameters()},
                                 {part: [calls[id(b.mlp)] for b in blocks] for part, blocks in towers.items()})
    (plain, plain_grads, plain_calls), (ac, ac_grads, ac_calls) = results[False], results[True]
    assert (plain_calls, ac_calls) == ({"vision": [1, 1], "language": [1, 1]}, {"vision": [2, 2], "language": [2, 2]})
    torch.testing.assert_close(ac, plain, rtol=0, atol=1e-6)
    for name, grad in plain_grads.items():
        assert (ac_grads[name] is None) == (grad is None), name
        if grad is not None:
            torch.testing.assert_close(ac_grads[name], grad, rtol=0, atol=1e-6, msg=name)
