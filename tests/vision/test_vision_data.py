"""Image chat data from `datasets` (docs/vision.md's data section): Image columns (bytes or paths, a list or
one image), save_to_disk directories and data.streaming give the rows and micro-batches the JSON Lines file
gives; images are kept as stored until their micro-batch, and a bad one is named (file and row, or line)."""

from __future__ import annotations

import contextlib
import functools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers.vision import make_images_data, make_vlm
from llmtrain.config import ConfigError, DataConfig, ModelConfig
from llmtrain.data import StreamingRows, StreamSteps, build
from llmtrain.data import vision as vision_data

SECTION = dict(format="chat", seq_len=128, packing=False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vision_data")
    make_vlm("llava", root / "llava")
    make_images_data(root / "data")
    return root


@functools.cache
def processor(assets: Path):
    return vision_data.load_processor(str(assets / "llava"), False, None)


def records(assets: Path) -> list[dict]:
    return [json.loads(line) for line in (assets / "data" / "train.jsonl").read_text().splitlines()]


def placeholders(record: dict) -> tuple[list[dict], list[str]]:
    """The record in the {"type": "image"} + images shape: its messages and its image paths."""
    messages, paths = json.loads(json.dumps(record["messages"])), list(record.get("images", []))
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if "image" in part:
                paths.append(part.pop("image"))
    return messages, paths


def save_image_dataset(assets: Path, name: str, as_bytes: bool, single: bool = False) -> Path:
    """train.jsonl's records as a save_to_disk dataset with an Image column (`images`, or one `image`), each image
    stored as its bytes or as its absolute path."""
    from datasets import Dataset, Image, List

    messages, images = zip(*(placeholders(r) for r in records(assets)))
    def stored(path: str):
        file = assets / "data" / path
        return {"bytes": file.read_bytes(), "path": None} if as_bytes else str(file)

    column = [stored(p) for (p,) in images] if single else [[stored(p) for p in ps] for ps in images]
    key = "image" if single else "images"
    ds = Dataset.from_dict({"messages": list(messages), key: column})
    ds = ds.cast_column(key, Image() if single else List(Image()))
    ds.save_to_disk(assets / name)
    return assets / name


def built_rows(assets: Path, path: Path) -> list[dict]:
    proc = processor(assets)
    return list(build(DataConfig(path=str(path), **SECTION), proc.tokenizer, 0, processor=proc).train)


def tokens(rows) -> list[tuple]:
    return [(tuple(map(int, r["input_ids"])), tuple(map(int, r["labels"]))) for r in rows]


def pixels(assets: Path, rows: list[dict]) -> torch.Tensor:
    return vision_data.collate(rows, processor(assets))[vision_data.MODEL_INPUT + "pixel_values"]


@pytest.mark.parametrize("stored", ["bytes", "one path"])
def test_an_image_column_saved_to_disk_gives_the_jsonl_rows_and_pixels(assets, stored):
    """A save_to_disk directory whose `images` (a list of bytes) or `image` (one file's path: save_to_disk embeds
    its bytes) is a datasets Image column: the rows' tokens and labels, and their micro-batch's pixel values, are
    the JSON Lines file's; the rows hold the images as stored, decoded only when their micro-batch is collated."""
    saved = save_image_dataset(assets, f"saved-{stored.replace(' ', '-')}", as_bytes=stored == "bytes",
                               single=stored == "one path")
    reference, rows = built_rows(assets, assets / "data" / "train.jsonl"), built_rows(assets, saved)
    assert tokens(rows) == tokens(reference) and len(rows) == len(records(assets))
    for row, (_, (path,)) in zip(rows, (placeholders(r) for r in records(assets))):
        assert row[vision_data.IMAGES] == [{"bytes": (assets / "data" / path).read_bytes(), "path": None}]
    torch.testing.assert_close(pixels(assets, rows[:4]), pixels(assets, reference[:4]), rtol=0, atol=0)


def test_an_image_stored_as_a_path_resolves_against_the_data_folder(assets):
    """An Image column's {"bytes": None, "path"} (as the Hub's datasets may store it) is a path, relative to the
    data's folder like a JSON Lines path; neither a path nor bytes is a bad record saying so."""
    folder = assets / "data"
    want = {"bytes": None, "path": str((folder / "images" / "0.png").resolve())}
    assert vision_data._source({"bytes": None, "path": "images/0.png"}, folder) == want
    assert vision_data._source("images/0.png", folder) == want
    with pytest.raises(vision_data.BadRecord, match="an image is dict, not a path or a datasets Image"):
        vision_data._source({"bytes": None, "path": None}, folder)


def test_a_bad_image_in_an_image_column_is_named_by_its_row(assets):
    """Unreadable bytes in a saved Image column stop the run (data.strict) naming the directory and the row;
    skipped otherwise."""
    from datasets import Dataset, Image, List

    messages, _ = placeholders(records(assets)[1])
    good = {"bytes": (assets / "data" / "images" / "0.png").read_bytes(), "path": None}
    ds = Dataset.from_dict({"messages": [messages, messages], "images": [[good], [{"bytes": b"junk", "path": None}]]})
    ds.cast_column("images", List(Image())).save_to_disk(assets / "bad")
    proc = processor(assets)
    with pytest.raises(ConfigError, match=r"bad, record 2: image \(bytes\): cannot be read"):
        build(DataConfig(path=str(assets / "bad"), strict=True, **SECTION), proc.tokenizer, 0, processor=proc)
    built = build(DataConfig(path=str(assets / "bad"), **SECTION), proc.tokenizer, 0, processor=proc)
    assert len(built.train) == 1 and built.stats.skipped == 1


@pytest.mark.parametrize("source", ["jsonl", "saved"])
def test_streamed_rows_are_the_map_rows_and_collate_with_their_images(assets, source, single_process_group):
    """data.streaming over a JSON Lines file (paths beside it) or a saved Image column: each record is a row of
    its own with the map-style rows' tokens (in the stream's order) and images; StreamSteps collates its
    micro-batches with the processor (the pixel values of those rows) and resumes from its position exactly."""
    path = assets / "data" / "train.jsonl" if source == "jsonl" else \
        save_image_dataset(assets, "saved-stream", as_bytes=True)
    proc = processor(assets)
    section = DataConfig(path=str(path), streaming=True, **SECTION)
    vision_data.check(section, ModelConfig(path=str(assets / "llava")), 1)  # not refused
    rows = list(StreamingRows(section, proc.tokenizer, 0, 0, 1, proc).rows(0))
    assert Counter(tokens(rows)) == Counter(tokens(built_rows(assets, assets / "data" / "train.jsonl")))
    assert all(len(r[vision_data.IMAGES]) == 1 for r in rows)

    def steps(position: dict) -> StreamSteps:
        return StreamSteps(StreamingRows(section, proc.tokenizer, 0, 0, 1, proc), 2, 1, torch.device("cpu"),
                           position, 1)

    run = steps({})
    (first,) = next(run)
    assert first["input_ids"].shape[0] == 2
    torch.testing.assert_close(first[vision_data.MODEL_INPUT + "pixel_values"], pixels(assets, rows[:2]),
                               rtol=0, atol=0)
    next(run)
    resumed = steps(run.position())
    for a, b in zip(next(run), next(resumed)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_bad_streamed_record_is_named_by_its_line(assets, tmp_path):
    """While streaming, a missing image stops the run naming file and line (data.strict) or is skipped."""
    lines = (assets / "data" / "train.jsonl").read_text().splitlines()
    bad = json.loads(lines[1])
    bad["images"] = ["gone.png"]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join([lines[0], json.dumps(bad), *lines[2:]]) + "\n")
    (tmp_path / "images").symlink_to(assets / "data" / "images")
    proc = processor(assets)
    section = DataConfig(path=str(data), streaming=True, strict=True, **SECTION)
    with pytest.raises(ConfigError, match=r"train.jsonl, line 2: image gone.png: no such file"):
        list(StreamingRows(section, proc.tokenizer, 0, 0, 1, proc).rows(0))
    section = DataConfig(path=str(data), streaming=True, **SECTION)
    with pytest.warns(UserWarning, match="image gone.png: no such file"):
        assert len(list(StreamingRows(section, proc.tokenizer, 0, 0, 1, proc).rows(0))) == len(lines) - 1


@pytest.mark.parametrize("impl", ["chunked", "full"])
def test_answer_accuracy_counts_the_rows_whose_every_trained_token_is_the_argmax(assets, impl, single_process_group):
    """val_answer_accuracy (a vision-language run's eval): greedy_hits is the full logits' argmax test at every
    trained position (chunked as full); a row counts when all of them hit. Half the rows get as labels the model's
    own argmax (so greedy decoding gives them exactly): the accuracy is 0.5."""
    from transformers import AutoModelForImageTextToText

    from llmtrain.data.formats import IGNORE, model_inputs
    from llmtrain.losses import token

    model = AutoModelForImageTextToText.from_pretrained(assets / "llava", dtype=torch.float32)
    rows = built_rows(assets, assets / "data" / "train.jsonl")
    batch = vision_data.collate(rows, processor(assets))
    with torch.no_grad():
        argmax = model(**model_inputs(batch), use_cache=False).logits.argmax(-1)
    trained = batch["labels"] != IGNORE
    fixed = batch["labels"].clone()
    fixed[1:, 1:] = torch.where(trained[1:, 1:], argmax[1:, :-1], IGNORE)  # rows 1.. answered greedily
    half = {"labels": torch.where(torch.arange(len(rows))[:, None] % 2 == 1, fixed, batch["labels"])}
    half = {**batch, **half}
    loss = token.TokenLoss(impl, model, torch.device("cpu"))
    hits = loss.greedy_hits(model, half)
    targets = token.next_token_targets(half["labels"])
    assert torch.equal(hits, (targets == IGNORE) | (argmax == targets))
    assert [bool(h) for h in hits.all(-1)] == [i % 2 == 1 for i in range(len(rows))]
    micro = [{k: v[i:i + 2] for k, v in half.items()} for i in range(0, len(rows), 2)]
    assert token.answer_accuracy(model, micro, torch.device("cpu"), contextlib.nullcontext, loss) == 0.5


def test_the_data_inspector_renders_image_rows_with_the_processor(assets, capsys):
    """`python -m llmtrain.data` on a config whose model.path is a vision-language model: the rows as its processor
    renders them (image tokens, the answer marked as trained), one example per row."""
    from llmtrain.data.__main__ import main

    config = assets / "inspect.yaml"
    config.write_text(f"model:\n  path: {assets / 'llava'}\ndata:\n  path: {assets / 'data' / 'train.jsonl'}\n"
                      "  format: chat\n  seq_len: 128\n  packing: false\n")
    assert main(["--config", str(config), "--n", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    answer = records(assets)[0]["messages"][1]["content"][0]["text"]
    assert "<image>" in "\n".join(out) and out[-1].startswith("--- 8 examples -> 8 rows; ")
    assert any(f"[[{answer}<|im_end|>]]" in line for line in out)
