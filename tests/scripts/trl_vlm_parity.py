"""llmtrain's vision-language micro-batches against TRL's DataCollatorForVisionLanguageModeling (what SFTTrainer
collates VLM chat data with, assistant_only_loss=True), on the same tiny LLaVA and Qwen2.5-VL and records.

TRL is a dev-only comparison, kept out of llmtrain's environment; run this with a Python that has trl installed
(TRL 1.16 was checked), from the repo root:

    PYTHONPATH=. /path/to/trl-venv/bin/python tests/scripts/trl_vlm_parity.py

Prints one line per family (the tensors compared, equal or not) and exits non-zero when any differs: ids,
labels, attention mask, pixel values and every other tensor the processor returns."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.vision import TRUST_REMOTE_CODE, make_images_data, make_vlm

from llmtrain.config import DataConfig
from llmtrain.data import vision
from llmtrain.data.formats import MODEL_INPUT


def trl_example(record: dict, base: Path) -> dict:
    """TRL's shape: {"type": "image"} placeholders and the images (PIL) in an `images` list."""
    messages = json.loads(json.dumps(record["messages"]))
    paths = list(record.get("images") or [])
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part["type"] == "image" and "image" in part:
                paths.append(part.pop("image"))
    return {"messages": messages, "images": [vision._open(str(base / p)) for p in paths]}


def main() -> int:
    worst = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_images_data(root / "data")
        records = [json.loads(line) for line in data.read_text().splitlines()]
        for family in TRUST_REMOTE_CODE:
            make_vlm(family, root / family)
            processor = vision.load_processor(str(root / family), TRUST_REMOTE_CODE[family], None)
            rows = [vision.encode(r, DataConfig(seq_len=256), processor, str(root / "data")) for r in records[:4]]
            ours = vision.collate(rows, processor)
            ours = {k.removeprefix(MODEL_INPUT): v for k, v in ours.items()}
            theirs = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True)(
                [trl_example(r, root / "data") for r in records[:4]])
            keys = sorted(set(ours) | set(theirs))
            different = [k for k in keys if k not in ours or k not in theirs
                         or not torch.equal(torch.as_tensor(ours[k]), torch.as_tensor(theirs[k]))]
            print(f"{family}: {', '.join(keys)}: " + (f"DIFFERENT {different}" if different else "all equal"))
            worst = max(worst, len(different))
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
