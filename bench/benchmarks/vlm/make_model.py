"""A tiny random Qwen2.5-VL with Qwen's vocabulary size (151,936 ids; the tokenizer is the bundled small one plus
Qwen's special tokens, as tests/helpers/vision.py builds it) and its processor (the PIL image processor, loaded as
remote code: transformers' own Qwen2_5_VLProcessor needs torchvision), saved as a Hugging Face directory in
OUT/model; and RECORDS chat records about coloured images of several sizes in OUT/data (train.jsonl, images/),
each in TRL's shape ({"type": "image"} placeholders, the paths in `images`), which both sides read.

    python bench/benchmarks/vlm/make_model.py OUT RECORDS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText

REPO = Path(__file__).resolve().parents[3]
QWEN_VOCAB = 151_936  # Qwen2.5(-VL)'s embedding rows


def main(out: Path, records: int) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from helpers.vision import FAMILIES, make_images_data

    config, processor = FAMILIES["qwen2_5_vl"](out / "model")
    config.text_config.vocab_size = QWEN_VOCAB
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(out / "model")
    processor.save_pretrained(out / "model")
    data = make_images_data(out / "data", n=records)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    for row in rows:
        for part in row["messages"][0]["content"]:
            if "image" in part:
                row["images"] = [part.pop("image")]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
