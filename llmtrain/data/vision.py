"""Chat records with images (data.format=chat with a vision-language model.path), rendered by the model's own
processor (AutoProcessor: whatever class it returns).

A record is TRL's shape: `messages` whose contents are lists of parts, {"type": "text", "text": ...} and
{"type": "image"} placeholders filled in order from an `images` column (or one image in an `image` column), or
{"type": "image", "image": PATH} parts; string contents are text. An image is a path (relative to the data file)
or, from a `datasets` Image column (a save_to_disk dir, parquet, the Hub), its stored {"bytes", "path"}: such
columns are read undecoded. When the data is read (rank 0, before training; as it streams past with
data.streaming), every image is opened and every record rendered once: a missing or unreadable image, a
placeholder count that does not match the images, or a record longer than data.seq_len (rows with images are
never cut: cutting would drop image tokens) is a bad record named by file and line. The rows keep the
conversation and the images' paths or bytes (on disk, memory-mapped) only; each micro-batch decodes its images
and runs the processor on them (collate), so a dataset of many images is never held in memory. Every tensor the
processor returns reaches the model (MODEL_INPUT: Qwen2.5-VL's mm_token_type_ids, image_grid_thw, ...); the
labels are the assistant tokens the template's {% generation %} marks give, so image tokens, prompts and padding
are never trained."""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path

import torch

from llmtrain.config import ConfigError, DataConfig, ModelConfig
from llmtrain.data.formats import GENERATION_BLOCK, MODEL_INPUT, Format, RowPart, Rows
from llmtrain.data.records import IGNORE, SHAREGPT_ROLES, BadRecord
from llmtrain.models import hf, vision

IMAGES, IMAGE = "images", "image"  # the columns of placeholder images, a list or one (TRL's names)


def check(data_section: DataConfig, model_section: ModelConfig, sp_size: int) -> None:
    """Set-up refusals of what does not work with a vision-language model.path (yet), each in one line;
    sp_size: parallel.sp_size."""
    if model_section.path is None or not vision.is_vision_type(hf.model_type(model_section.path)):
        return
    if data_section.packing:
        raise ConfigError("data.packing: rows with images are padded, not packed (packing would let one example's "
                          "tokens attend to another's image); set data.packing=false")
    if data_section.train_on_prompt:
        raise ConfigError("data.train_on_prompt: not with a vision-language model.path (its prompts hold image "
                          "tokens, which are never trained); set data.train_on_prompt=false")
    if data_section.sources or data_section.format != "chat":
        raise ConfigError("data.format: a vision-language model.path trains on data.format=chat (one data.path)")
    if sp_size > 1:
        raise ConfigError(f"parallel.sp_size={sp_size}: sequence parallelism splits text rows only, not a "
                          "vision-language model's; set parallel.sp_size=1")


def processor_for(model_section: ModelConfig, template: str | None):
    """model.path's processor when it is a vision-language model (load_processor), else None."""
    if model_section.path is None or not vision.is_vision_type(hf.model_type(model_section.path)):
        return None
    return load_processor(model_section.path, model_section.trust_remote_code, template)


def load_processor(path: str, trust_remote_code: bool, template: str | None):
    """model.path's processor, with data.chat_template (its text) in place of its own when given; the template
    must mark the assistant's turns with {% generation %} (they are the trained tokens); right padding."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not hasattr(processor, "image_processor"):
        raise ConfigError(f"model.path: {path} holds a vision-language model but AutoProcessor finds no image "
                          f"processor there (it returned a {type(processor).__name__})")
    if template is not None:
        processor.chat_template = template
    if not processor.chat_template or not GENERATION_BLOCK.search(processor.chat_template):
        raise ConfigError(f"the chat template of {path}'s processor has no {{% generation %}} marks around the "
                          "assistant's turns, which say what is trained; set data.chat_template to one that has")
    processor.tokenizer.padding_side = "right"
    return processor


def _parts(content, role: str) -> list[dict]:
    """A message's content -> its parts: {"type": "text", "text"} and {"type": "image"[, "image": path]}."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise BadRecord(f"a {role} turn has no content (text or a list of parts)")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            source = part.get("image") or part.get("path")
            parts.append({"type": "image", **({"image": source} if source is not None else {})})
        else:
            raise BadRecord(f"a {role} turn has a part that is neither {{'type': 'text', 'text': ...}} nor "
                            "{'type': 'image'}")
    return parts


def _messages(record: dict, section: DataConfig) -> list[dict]:
    raw = record.get(section.messages_field)
    if not isinstance(raw, list) or not raw:
        raise BadRecord(f"no {section.messages_field!r} list")
    messages = []
    for turn in raw:
        role = SHAREGPT_ROLES.get(turn.get("role")) if isinstance(turn, dict) else None
        if role is None:
            raise BadRecord(f"unknown role {turn.get('role') if isinstance(turn, dict) else turn!r}")
        messages.append({"role": role, "content": _parts(turn.get("content"), role)})
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant turn")
    return messages


def _open(source):
    """An image (a path, or {"bytes", "path"} as a datasets Image column stores it), decoded (PIL), as RGB."""
    from PIL import Image

    if isinstance(source, dict):
        source = io.BytesIO(source["bytes"]) if source["bytes"] else source["path"]
    with Image.open(source) as image:
        return image.convert("RGB")


def _source(value, base: Path) -> dict:
    """An image of a record -> {"bytes", "path"}: a path resolved against the data file's folder, or the
    bytes (and original name) of a datasets Image column."""
    if isinstance(value, str):
        return {"bytes": None, "path": str((base / value).resolve())}
    if isinstance(value, dict) and value.get("bytes"):
        return {"bytes": value["bytes"], "path": None}
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        return _source(value["path"], base)
    raise BadRecord(f"an image is {type(value).__name__}, not a path or a datasets Image")


def _images(messages: list[dict], record: dict, base: Path) -> list[dict]:
    """The record's images in the order of its image parts ({"bytes", "path"}), each opened once (BadRecord when
    missing or unreadable); the parts keep no source."""
    column = record.get(IMAGES) or ([record[IMAGE]] if record.get(IMAGE) is not None else [])
    if not isinstance(column, list):
        raise BadRecord(f"{IMAGES!r} is {type(column).__name__}, not a list of images")
    placeholders = [p for m in messages for p in m["content"] if p["type"] == "image"]
    inline = [p.pop("image") for p in placeholders if "image" in p]
    if inline and column:
        raise BadRecord(f"images both in the parts and in {IMAGES!r}: give them one way")
    sources = [_source(value, base) for value in inline or column]
    if len(sources) != len(placeholders):
        raise BadRecord(f"{len(placeholders)} image placeholders but {len(sources)} images")
    for value, source in zip(inline or column, sources):
        try:
            _open(source)
        except (OSError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
            name = value if isinstance(value, str) else value.get("path") or "(bytes)"
            gone = source["path"] is not None and not Path(source["path"]).is_file()
            raise BadRecord(f"image {name}: {'no such file' if gone else 'cannot be read'} "
                            f"({type(e).__name__})") from None
    return sources


def render(processor, conversations: list[list[dict]], images: list[list]) -> dict:
    """The processor's batch (padded right, tensors) with the assistant tokens' mask."""
    return processor.apply_chat_template(
        conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        # The template writes the special tokens itself (as for text chat, and as TRL passes it).
        processor_kwargs={"images": images if any(images) else None, "padding": True, "return_tensors": "pt",
                          "add_special_tokens": False})


def encode(record: dict, section: DataConfig, processor, base: str) -> dict:
    """A record -> its conversation (image parts without sources), its images and its rendered tokens."""
    messages = _messages(record, section)
    images = _images(messages, record, Path(base))
    out = render(processor, [messages], [[_open(i) for i in images]])
    ids, mask = out["input_ids"][0].tolist(), list(out["assistant_masks"][0])
    if len(ids) > section.seq_len:
        raise BadRecord(f"{len(ids)} tokens with its images, longer than data.seq_len={section.seq_len} (rows "
                        "with images are never cut); raise data.seq_len")
    if not any(mask):
        raise BadRecord("the chat template rendered no assistant tokens")
    return {"messages_json": json.dumps(messages), IMAGES: images, "input_ids": ids,
            "labels": [t if m else IGNORE for t, m in zip(ids, mask)]}


def collate(rows: list[dict], processor) -> dict[str, torch.Tensor]:
    """A micro-batch: its images opened now, rendered by the processor; the labels are the assistant tokens."""
    out = render(processor, [json.loads(r["messages_json"]) for r in rows],
                 [[_open(i) for i in r[IMAGES]] for r in rows])
    ids = out.pop("input_ids")
    mask = torch.as_tensor(out.pop("assistant_masks")).bool() & out["attention_mask"].bool()
    return {"input_ids": ids, "labels": ids.masked_fill(~mask, IGNORE),
            **{MODEL_INPUT + k: torch.as_tensor(v) for k, v in out.items()}}


IMAGE_ROWS = Rows(
    "tokens",  # token rows to the recipes (ids and labels), collated a micro-batch at a time by the processor
    lambda example, fmt, section: {**example, "truncated": False},
    {"messages_json": "[]", IMAGES: [], "input_ids": [], "labels": [], "truncated": False},
    packs=False,
    parts=lambda row: [RowPart("", list(map(int, row["input_ids"])), list(map(int, row["labels"])))])


def features(**extra: str):
    """The stored rows' column types, and `extra` columns' (name=datasets Value dtype): typed up front, since a
    batch of paths alone would leave the images' bytes untyped."""
    from datasets import Features, List, Value

    image = {"bytes": Value("binary"), "path": Value("string")}
    return Features({"messages_json": Value("string"), IMAGES: List(image),
                     "input_ids": List(Value("int64")), "labels": List(Value("int64")), "truncated": Value("bool"),
                     **{name: Value(dtype) for name, dtype in extra.items()}})


def undecoded(features):
    """`datasets` features whose Image columns (at any depth) give their stored {"bytes", "path"}: the images are
    decoded per micro-batch; the other columns (JSON parts among them) decode as they do."""
    import copy

    from datasets import Image

    features = copy.deepcopy(features)
    todo = [features]
    while todo:
        feature = todo.pop()
        if isinstance(feature, Image):
            feature.decode = False
        todo += feature.values() if isinstance(feature, dict) else [getattr(feature, "feature", None) or {}]
    return features


def undecoded_stream(stream):
    """A streamed dataset with its Image columns undecoded (undecoded); lazily, as streams cast."""
    return stream.cast(undecoded(stream.features)) if stream.features else stream


def chat_format(base: Path) -> Format:
    """data.format=chat for a vision-language model: image paths resolve against `base` (the data file's folder)."""
    return Format("chat", functools.partial(encode, base=str(base)), IMAGE_ROWS, chat_template=True)


def collate_with(processor):
    """Built.collate for rows of this module."""
    return functools.partial(collate, processor=processor)
