"""What the preference tests share (test_preference, test_dpo, test_orpo_cpo, test_reward): the demo pairs and the
DPO recipe's command line, step 1's batch as the recipes collate it, per-row log-probs in transformers and written
out by hand, random logits and labels, a tiny Llama."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import REPO
from llmtrain import data
from llmtrain.config import DataConfig
from llmtrain.data.formats import IGNORE
from llmtrain.models.hf import load_tokenizer

DPO = REPO / "recipes" / "dpo.py"
PAIRS = REPO / "data" / "demo" / "preference.jsonl"


def dpo_args(base: Path, *extra: str) -> list[str]:
    return ["model.config=null", f"model.path={base}", f"data.path={PAIRS}", "data.format=preference",
            "train.max_steps=3", *extra]


def first_batch(path: Path = PAIRS, pairs: int = 4) -> dict[str, torch.Tensor]:
    """The first `pairs` pairs of `path` as the recipe collates them (one process, tiny.yaml's seed 7): by default
    step 1's batch of 4."""
    tokenizer = load_tokenizer(str(REPO / "assets" / "tokenizer"), False)
    built = data.build(DataConfig(path=str(path), format="preference", seq_len=64), tokenizer, seed=7)
    (batch,) = next(data.make_steps(built, pairs, 1, 1, 0, 7, torch.device("cpu"), {}))
    return batch


def sequence_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-prob of each row's response tokens, and their count."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.float()
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return (logp * mask).sum(1), mask.sum(1)


def random_batch(seed: int, pairs: int = 8, length: int = 12, vocab: int = 17):
    """Logits of a policy and a reference, and labels with prompts, responses and padding of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.full((2 * pairs, length), IGNORE)
    for row in range(2 * pairs):
        start = int(torch.randint(1, 5, (1,), generator=g))
        end = int(torch.randint(start + 1, length + 1, (1,), generator=g))
        labels[row, start:end] = torch.randint(0, vocab, (end - start,), generator=g)
    return (torch.randn(2 * pairs, length, vocab, generator=g) * 2, torch.randn(2 * pairs, length, vocab, generator=g),
            labels)


def plain_logps(logits, labels) -> tuple[list[float], list[int]]:
    """Per row: Σ over response tokens t of log softmax(logits[t-1])[token t], and the token count."""
    sums, counts = [], []
    for row in range(labels.shape[0]):
        total, n = 0.0, 0
        for t in range(1, labels.shape[1]):
            if labels[row, t] != IGNORE:
                total += torch.log_softmax(logits[row, t - 1].double(), -1)[labels[row, t]].item()
                n += 1
        sums.append(total)
        counts.append(n)
    return sums, counts


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).float()


def assert_splits_match_the_whole_batch(run) -> None:
    """run(splits) -> (loss, metrics, gradients) of 6 pairs split into micro-batches [(start, end), ...]: split
    into 1, 2 and 3 pairs (as ranks and accumulation would), they equal the whole batch's."""
    whole = run([(0, 6)])
    split = run([(0, 1), (1, 3), (3, 6)])
    assert split[0] == pytest.approx(whole[0], rel=1e-5, abs=1e-6)
    assert split[1] == pytest.approx(whole[1], rel=1e-5, abs=1e-5)
    for a, b in zip(split[2], whole[2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
