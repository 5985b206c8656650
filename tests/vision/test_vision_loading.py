"""Each vision-language family (LLaVA, Qwen2.5-VL, Gemma 3, Idefics3, SmolVLM) built and loaded by the library as a
run builds it (models.build.build_model: meta -> wrap -> each rank's slices of model.path) is from_pretrained's:
every parameter and buffer equal, and the full logits on a batch with images. In this process, on a 1-rank gloo
group (no launch): none and fsdp2; and its export gives its logits."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, SmolVLMConfig

from helpers.procs import finish_recipe, losses_by_step, start_recipe
from helpers.vision import FAMILIES as MAKERS
from helpers.vision import TRUST_REMOTE_CODE, make_images_data, make_vlm
from llmtrain import distributed
from llmtrain.config import DataConfig, ModelConfig, ParallelConfig
from llmtrain.data import vision as vision_data
from llmtrain.data.formats import model_inputs
from llmtrain.models import hf as model_lib
from llmtrain.models import vision
from llmtrain.models.build import build_model
from llmtrain.models.names import clean_name

FAMILIES = ["llava", "qwen2_5_vl", "gemma3", "idefics3", "smolvlm"]
TRUST = {**TRUST_REMOTE_CODE, "smolvlm": False}


def make_smolvlm(path: Path) -> Path:
    """SmolVLM (Idefics3's modules under model_type smolvlm) with Idefics3's processor: SmolVLM's own needs
    torchvision (its video processor), and for one image without splitting both render the same tokens
    (<fake_token_around_image><global-img>, the image tokens, <fake_token_around_image>)."""
    config, processor = MAKERS["idefics3"](path)
    tiny = config.to_dict()
    smol = SmolVLMConfig(text_config=tiny["text_config"], vision_config=tiny["vision_config"], scale_factor=2,
                         image_token_id=config.image_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(smol, dtype=torch.float32).save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vision_loading")
    for family in FAMILIES:
        make_smolvlm(root / family) if family == "smolvlm" else make_vlm(family, root / family)
    make_images_data(root / "data")
    return root


@functools.cache
def processor(assets: Path, family: str):
    return vision_data.load_processor(str(assets / family), TRUST[family], None)


def image_batch(assets: Path, family: str) -> dict[str, torch.Tensor]:
    """Four records with images (two sizes: Qwen's patch grids differ), rendered by the family's processor."""
    proc = processor(assets, family)
    records = [json.loads(line) for line in (assets / "data" / "train.jsonl").read_text().splitlines()[:4]]
    rows = [vision_data.encode(r, DataConfig(seq_len=128), proc, str(assets / "data")) for r in records]
    return model_inputs(vision_data.collate(rows, proc))


@pytest.mark.parametrize("strategy", ["none", "fsdp2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_model_is_from_pretrained(assets, single_process_group, family, strategy):
    """Every parameter (the full state dict), every buffer (RoPE inv_freq of both towers, position ids, Gemma's
    embed_scale) and the full logits on an image + text batch equal from_pretrained's; the vision tower is
    frozen (model.freeze's default) and the rest trains."""
    section = ModelConfig(path=str(assets / family), trust_remote_code=TRUST[family])
    config = model_lib.load_model_config(section, processor(assets, family).tokenizer)
    env = distributed.DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    built = build_model(section, config, ParallelConfig(strategy=strategy), env, seed=0)
    reference = AutoModelForImageTextToText.from_pretrained(section.path, dtype=torch.float32).eval()
    assert reference.config.model_type == family

    full, want = built.plan.strategy.full_weights(built.model, env.device), reference.state_dict()
    assert full.keys() == want.keys()
    for name, tensor in full.items():
        assert torch.equal(tensor, want[name]), name
    buffers = dict(reference.named_buffers())
    assert {clean_name(n) for n, _ in built.model.named_buffers()} == set(buffers)
    for name, buffer in built.model.named_buffers():
        assert torch.equal(buffer, buffers[clean_name(name)]), name
    tower = vision.part_params(built.model, "vision_tower")
    assert tower and all(p.requires_grad == (id(p) not in tower) for p in built.model.parameters())

    batch = image_batch(assets, family)
    assert batch["pixel_values"].numel()
    built.model.eval()
    with torch.no_grad():
        logits = built.model(**batch, use_cache=False).logits
        torch.testing.assert_close(logits, reference(**batch, use_cache=False).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_gives_the_models_logits(assets, single_process_group, tmp_path, family):
    """The export (export_hf from fsdp2's shards, with the processor) of a model whose trained parts changed loads
    with AutoModelForImageTextToText and gives that model's full logits on a batch with images."""
    from llmtrain import export

    section = ModelConfig(path=str(assets / family), trust_remote_code=TRUST[family])
    proc = processor(assets, family)
    config = model_lib.load_model_config(section, proc.tokenizer)
    env = distributed.DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    built = build_model(section, config, ParallelConfig(strategy="fsdp2"), env, seed=0)
    with torch.no_grad():
        for p in built.model.parameters():
            if p.requires_grad:
                p.mul_(1.25)
    export.export_hf(built.model, built.plan.strategy, env.device, tmp_path / "hf", config, proc.tokenizer,
                     processor=proc)
    batch = image_batch(assets, family)
    built.model.eval()
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = built.model(**batch, use_cache=False).logits
        torch.testing.assert_close(exported(**batch, use_cache=False).logits, logits, rtol=0, atol=1e-5)
        original = AutoModelForImageTextToText.from_pretrained(section.path, dtype=torch.float32).eval()
        assert (original(**batch, use_cache=False).logits - logits).abs().max() > 1e-2


# 3 steps of 4 rows (micro 2 x accumulation 2 on 1 process, micro 1 on 2 ranks); YAML is a superset of JSON
SMOL_RUN = {"data": {"format": "chat", "seq_len": 128, "packing": False},
            "train": {"max_steps": 3, "micro_batch_size": 2, "grad_accum_steps": 2, "lr": 1e-3, "warmup_steps": 1,
                      "weight_decay": 0.1, "seed": 7},
            "eval": {"every_steps": 3}, "log": {"every_steps": 1, "progress": False}}


@pytest.mark.slow
def test_smolvlm_trains_alike_on_one_and_two_ranks(assets):
    """SmolVLM through the recipe: 3 steps unwrapped on 1 process (micro 2 x accumulation 2) and under fsdp2 on 2
    ranks (micro 1): the same losses (1e-5), falling; the export's vision tower is the original's bit for bit
    while the projector and the language model changed."""
    config = assets / "smol.yaml"
    data = str(assets / "data" / "train.jsonl")
    config.write_text(json.dumps({**SMOL_RUN, "data": {**SMOL_RUN["data"], "path": data, "val_path": data}}))
    splits = {"none": (1, ["parallel.strategy=none"]),
              "fsdp2": (2, ["parallel.strategy=fsdp2", "train.micro_batch_size=1"])}
    running = {split: start_recipe(assets / "smol" / split, f"model.path={assets / 'smolvlm'}", *overrides,
                                   nproc=nproc, config=config) for split, (nproc, overrides) in splits.items()}
    for proc in running.values():
        finish_recipe(proc)
    losses = {split: [loss for _, loss in sorted(losses_by_step(assets / "smol" / split).items())]
              for split in splits}
    assert len(losses["none"]) == 3 and losses["none"][-1] < losses["none"][0]
    assert losses["fsdp2"] == pytest.approx(losses["none"], abs=1e-5)
    trained = AutoModelForImageTextToText.from_pretrained(assets / "smol" / "fsdp2" / "hf", dtype=torch.float32)
    original = dict(AutoModelForImageTextToText.from_pretrained(assets / "smolvlm", dtype=torch.float32)
                    .named_parameters())
    assert trained.config.model_type == "smolvlm"
    tower = vision.part_params(trained, "vision_tower")
    for name, p in trained.named_parameters():
        assert torch.equal(p, original[name]) == (id(p) in tower), name
