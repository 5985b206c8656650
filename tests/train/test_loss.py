"""train.loss_impl: the chunked loss gives the full-logits loss and gradients (in-process on tiny models:
tied and untied embeddings, Gemma 2's final logit soft-capping, ignored positions and rows), and so do its
per-token log-probs under a DPO-style weighted sum; it refuses a model whose logits it cannot reproduce,
and matches the reference run under FSDP1/FSDP2 in many chunks."""

from __future__ import annotations

import pytest
import torch
from transformers import CohereConfig

from helpers import RECIPE
from helpers.heads import CONFIGS, HEADS, SEQ, SMALL, VOCAB, batch, loss_and_grads, tiny, tiny_head
from helpers.procs import losses, run_side_by_side
from llmtrain.config import ConfigError
from llmtrain.data.formats import IGNORE
from llmtrain.losses.token import TokenLoss, check, token_logps, token_loss_sum


@CONFIGS
@HEADS
def test_chunked_matches_full_loss_and_gradients(config, head):
    model, b = tiny_head(config, head), batch()
    chunked = TokenLoss("chunked", model, torch.device("cpu"), chunk_tokens=5)  # 16 trained tokens: 4 chunks
    full_loss, full_grads = loss_and_grads(model, lambda: token_loss_sum(model(
        input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits, b["labels"]))
    loss, grads = loss_and_grads(model, lambda: chunked.loss_sum(model, b))
    assert loss.item() == pytest.approx(full_loss.item(), rel=1e-5, abs=1e-5)
    for name, g in full_grads.items():
        assert (grads[name] - g).abs().max().item() < 1e-5, name
    with torch.no_grad():  # the eval path
        assert chunked.loss_sum(model, b).item() == pytest.approx(full_loss.item(), rel=1e-5, abs=1e-5)
    # the model is left as it was: no hook, its own loss function
    out = model(input_ids=b["input_ids"], labels=b["input_ids"])
    assert out.logits.shape == (3, SEQ, VOCAB) and torch.isfinite(out.loss)


@CONFIGS
@HEADS
def test_chunked_token_logps_match_full_logps_and_gradients(config, head):
    """DPO's use: per-token log-probs whose downstream gradient (here random weights, through a nonlinearity
    as DPO's log-sigmoid of row sums) is known only after the forward; and the no-grad reference path."""
    model, b = tiny_head(config, head), batch()
    chunked = TokenLoss("chunked", model, torch.device("cpu"), chunk_tokens=5)
    weights = torch.randn(15, generator=torch.Generator().manual_seed(2))  # one per trained token

    def weighted(logps: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.logsigmoid((weights * logps).sum() / 15) * 15

    full = TokenLoss("full", model, torch.device("cpu"))
    want, want_grads = loss_and_grads(model, lambda: weighted(full.token_logps(model, b)))
    got, grads = loss_and_grads(model, lambda: weighted(chunked.token_logps(model, b)))
    assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-5)
    for name, g in want_grads.items():
        assert (grads[name] - g).abs().max().item() < 1e-5, name
    full_logps = full.token_logps(model, b)
    assert full_logps.shape == (15,) and torch.equal(full_logps, token_logps(model(
        input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits, b["labels"]))
    assert (chunked.token_logps(model, b) - full_logps).abs().max().item() < 1e-5
    with torch.no_grad():
        assert (chunked.token_logps(model, b) - full_logps).abs().max().item() < 1e-5
        empty = {**b, "labels": torch.full_like(b["labels"], IGNORE)}  # eval's filler batch: nothing trained
        assert chunked.token_logps(model, empty).shape == (0,)


def test_unreproduced_logit_transform_is_refused():
    model = tiny(CohereConfig(**SMALL, logit_scale=0.5))  # Cohere scales its logits after lm_head
    with pytest.raises(ConfigError, match="train.loss_impl=full"):
        TokenLoss("chunked", model, torch.device("cpu"))
    assert TokenLoss("full", model, torch.device("cpu")).impl == "full"


def test_liger_needs_cuda():
    with pytest.raises(ConfigError, match="train.loss_impl=liger.*cpu"):
        check("liger", "cpu")


@pytest.mark.slow
def test_chunked_under_fsdp_matches_reference(tmp_path, reference):
    """Many chunks per micro-batch under FSDP1 and FSDP2 (the output layer in the root unit), and the full
    path through the recipe, against the reference run (chunked by default, one process)."""
    splits = [("fsdp", 2, ["parallel.strategy=fsdp", "train.loss_chunk_tokens=16"]),
              ("fsdp2", 2, ["parallel.strategy=fsdp2", "train.loss_chunk_tokens=16"]),
              ("full", 1, ["parallel.strategy=none", "train.loss_impl=full", "train.grad_accum_steps=2"])]
    runs = {name: (tmp_path / name, nproc, [*overrides, "train.micro_batch_size=2"], RECIPE)
            for name, nproc, overrides in splits}
    results = run_side_by_side(runs, at_once=len(runs))
    for name in runs:
        assert losses(tmp_path / name) == pytest.approx(reference, abs=2e-5), name
    assert "loss: chunked (train.loss_impl=chunked: logits of at most 16 trained tokens" in results["fsdp"].stdout
    assert "loss: full logits" in results["full"].stdout
