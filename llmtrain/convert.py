"""Offline converter: a sharded training checkpoint -> the Hugging Face layout of the recipe's export.

    python -m llmtrain.convert output_dir/checkpoints/step_<N> OUT [--dtype bf16] [--max-shard-size 5GB]

One process, no GPU, no process group. Each model tensor is allocated once, in the target dtype, and
DCP reads the shards straight into it: never more than one full copy of the weights."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmtrain.checkpoint import HF_CONFIG_DIR, STATE_FILE, is_complete, verify, write_hf
from llmtrain.parallelize import DTYPES

PREFIX = "model."


def convert(ckpt: Path, out: Path, dtype: str, max_shard_size: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    if not is_complete(ckpt):
        raise SystemExit(f"error: {ckpt} is not a complete llmtrain checkpoint (no {STATE_FILE} or .metadata)")
    if problems := verify(ckpt):
        raise SystemExit(f"error: {ckpt} fails verification: {'; '.join(problems[:3])}")
    reader = dcp.FileSystemReader(str(ckpt))
    meta = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(m.size, dtype=DTYPES[dtype]) for key, m in meta.items()
             if key.startswith(PREFIX) and isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    config = AutoConfig.from_pretrained(ckpt / HF_CONFIG_DIR)
    tokenizer = AutoTokenizer.from_pretrained(ckpt / HF_CONFIG_DIR)
    weights = {key[len(PREFIX):]: state.pop(key) for key in list(state)}
    write_hf(weights, out, config, tokenizer, DTYPES[dtype], max_shard_size)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrain.convert", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="output_dir/checkpoints/step_<N>")
    p.add_argument("out", type=Path, help="directory to write (replaced atomically if it exists)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--max-shard-size", default="5GB")
    args = p.parse_args(argv)
    convert(args.checkpoint, args.out, args.dtype, args.max_shard_size)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
