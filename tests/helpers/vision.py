"""Tiny random vision-language models (LLaVA, Qwen2.5-VL) built from their transformers configs and saved with
their processors (the PIL image processors: torchvision is not installed), and chat data with images.

transformers' Qwen2_5_VLProcessor cannot be built without torchvision (its video processor); the Qwen directory
carries qwen_image_processor.py (the same processor without the video part) as remote code, loaded with
model.trust_remote_code=true, through AutoProcessor as any processor is."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (AutoModelForImageTextToText, AutoTokenizer, CLIPImageProcessorPil, CLIPVisionConfig,
                          Gemma3Config, Gemma3ImageProcessorPil, Gemma3Processor, Idefics3Config,
                          Idefics3ImageProcessorPil, Idefics3Processor, LlamaConfig, LlavaConfig, LlavaProcessor,
                          Qwen2_5_VLConfig, Qwen2VLImageProcessorPil)

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, tie_word_embeddings=False)


def _template(begin: str, end: str, image: str) -> str:
    """A chat template over string or list-of-parts contents, the assistant's turns in {% generation %}."""
    return ("{%- for message in messages %}{{- '" + begin + "' + message['role'] + '\\n' }}"
            "{%- if message['content'] is string %}{%- set parts = [{'type': 'text', 'text': message['content']}] %}"
            "{%- else %}{%- set parts = message['content'] %}{%- endif %}"
            "{%- if message['role'] == 'assistant' %}{%- generation %}{%- for p in parts %}{{- p['text'] }}"
            "{%- endfor %}{{- '" + end + "' }}{%- endgeneration %}{{- '\\n' }}"
            "{%- else %}{%- for p in parts %}{%- if p['type'] == 'image' %}{{- '" + image + "' }}{%- else %}"
            "{{- p['text'] }}{%- endif %}{%- endfor %}{{- '" + end + "\\n' }}{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '" + begin + "assistant\\n' }}{%- endif %}")


def _tokenizer(special: list[str], named: dict[str, str] | None = None):
    """The bundled tokenizer with the chat markers and a family's image tokens; `named`: tokens the processor
    reads as the tokenizer's attributes (Gemma 3's boi_token, image_token...)."""
    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer", extra_special_tokens=named or {})
    tok.add_special_tokens({"additional_special_tokens": special})
    return tok


def _llava(path: Path):
    tok = _tokenizer(["<|im_start|>", "<|im_end|>", "<image>"])
    text = LlamaConfig(**SHAPE, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=16, patch_size=4, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-1, tie_word_embeddings=False)
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 16},
                                                                     crop_size={"height": 16, "width": 16}),
                               tokenizer=tok, patch_size=4, vision_feature_select_strategy="default",
                               image_token="<image>", num_additional_image_tokens=1,
                               chat_template=_template("<|im_start|>", "<|im_end|>", "<image>"))
    return config, processor


def _qwen2_5_vl(path: Path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from qwen_image_processor import Qwen2_5_VLImageProcessor

    special = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = _tokenizer(special)
    ids = {t: tok.convert_tokens_to_ids(t) for t in special}
    text = dict(SHAPE, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                             out_hidden_size=64, patch_size=4, spatial_merge_size=2,
                                             temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    Qwen2_5_VLImageProcessor.register_for_auto_class("AutoProcessor")
    processor = Qwen2_5_VLImageProcessor(
        image_processor=Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                 min_pixels=16 * 16, max_pixels=32 * 32),
        tokenizer=tok, chat_template=_template("<|im_start|>", "<|im_end|>",
                                               "<|vision_start|><|image_pad|><|vision_end|>"))
    return config, processor


def _gemma3(path: Path):
    """Gemma 3 (image-text): a SigLIP tower without its pooling head, the projector's average pool to 2 x 2
    soft tokens, a Gemma 3 decoder with a sliding-window layer; the processor's token_type_ids make the image
    tokens attend both ways in training."""
    tok = _tokenizer(["<|im_start|>", "<|im_end|>"], {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                      "image_token": "<image_soft_token>"})
    text = dict(SHAPE, head_dim=16, vocab_size=len(tok), sliding_window=8, layer_types=["sliding_attention",
                                                                                       "full_attention"],
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=4, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
                          eoi_token_index=tok.eoi_token_id, tie_word_embeddings=False)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 16, "width": 16}),
                                tokenizer=tok, image_seq_length=4,
                                chat_template=_template("<|im_start|>", "<|im_end|>", "<start_of_image>"))
    return config, processor


def _idefics3(path: Path):
    """Idefics3 (SmolVLM's architecture): a SigLIP-like tower, the connector's pixel shuffle (scale 2) and
    projection, a Llama decoder; one 16 x 16 image each (no splitting), 4 image tokens."""
    tok = _tokenizer(["<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>", "<global-img>",
                      "<end_of_utterance>"])
    text = dict(SHAPE, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=4)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                            image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(size={"longest_edge": 16}, max_image_size={"longest_edge": 16},
                                                  do_image_splitting=False),
        tokenizer=tok, image_seq_len=4, chat_template=_template("<|im_start|>", "<|im_end|>", "<image>"))
    return config, processor


FAMILIES = {"llava": _llava, "qwen2_5_vl": _qwen2_5_vl, "gemma3": _gemma3, "idefics3": _idefics3}
# What each family's config needs to load (Qwen's processor is remote code here).
TRUST_REMOTE_CODE = {"llava": False, "qwen2_5_vl": True, "gemma3": False, "idefics3": False}


def make_vlm(family: str, path: Path, seed: int = 0) -> Path:
    """A random tiny `family` model with its processor, saved to `path` as a Hugging Face directory."""
    config, processor = FAMILIES[family](path)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(path)
    processor.save_pretrained(path)
    return path


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30)}


def make_images_data(folder: Path, n: int = 8, seed: int = 0) -> Path:
    """`n` chat records about coloured images (sizes vary, so Qwen's patch grids differ), half with
    {"type": "image"} placeholders and an images column, half with the path in the part; images/ beside."""
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    names, rows = list(COLOURS), []
    for i in range(n):
        colour = names[int(torch.randint(len(names), (1,), generator=g))]
        size = (16 + 8 * (i % 3), 16 + 8 * (i % 2))
        Image.new("RGB", size, COLOURS[colour]).save(folder / "images" / f"{i}.png")
        image = {"type": "image"} if i % 2 else {"type": "image", "image": f"images/{i}.png"}
        record = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "What colour is it?"}]},
                               {"role": "assistant", "content": [{"type": "text", "text": f"It is {colour}."}]}]}
        if i % 2:
            record["images"] = [f"images/{i}.png"]
        rows.append(record)
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
