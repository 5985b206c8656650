"""llmtrain.rollout.local's compaction (finished rows leave the batch) samples exactly what decoding every row to
the end samples: the same token ids, masks, lengths and truncation, bit for bit, at several temperatures and
top-k / top-p, with completions of very different lengths (an EOS id the model favours stops most rows early),
and log-probs equal to the last bits; the log-probs are those of the sampled tokens under the distribution
they were drawn from; and under FSDP1 (lockstep) and FSDP2 a rank whose rows all stopped behaves."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from helpers.compaction import CPU, KEYS, MAX, PAD, ROWS, model_and_eos
from helpers.procs import run_strategies
from llmtrain.rollout.local import Sampling, filter_logits, generate

STRATEGIES = ["fsdp", "fsdp2"]  # lockstep decoding, and not

@pytest.mark.parametrize("sampling", [Sampling(MAX), Sampling(MAX, temperature=0.7), Sampling(MAX, temperature=1.6),
                                      Sampling(MAX, temperature=0.9, top_k=8), Sampling(MAX, top_p=0.8),
                                      Sampling(MAX, temperature=1.2, top_k=20, top_p=0.9)],
                         ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_compaction_samples_what_decoding_every_row_samples(sampling):
    model, eos = model_and_eos()
    compacted = generate(model, ROWS, KEYS, sampling, eos, PAD, CPU)
    full = generate(model, ROWS, KEYS, sampling, eos, PAD, CPU, compact=False)
    for name in ("ids", "mask", "lengths", "truncated"):
        assert torch.equal(getattr(compacted, name), getattr(full, name)), name
    # CPU matmuls round differently at another row count (a Linear's outputs for 5 of 18 rows differ from the
    # 18-row call's by ~1e-7), so log-probs differ in the last bits; a token would flip only when its uniform
    # fell within that distance of a boundary of the cumulative distribution (none here).
    torch.testing.assert_close(compacted.logps, full.logps, atol=2e-6, rtol=0)
    lengths = compacted.lengths
    # Very different lengths: rows stop early, others run to the limit (so compaction did drop rows).
    assert lengths.min() <= MAX // 4 and compacted.truncated.any() and not compacted.truncated.all(), lengths.tolist()


def test_logps_are_the_sampling_distributions():
    """Each returned log-prob equals log_softmax(filter(logits / T)) of a teacher-forced forward at that token."""
    model, eos = model_and_eos()
    for sampling in (Sampling(MAX, temperature=0.8), Sampling(MAX, temperature=1.1, top_k=10, top_p=0.85)):
        c = generate(model, ROWS, KEYS, sampling, eos, PAD, CPU)
        for i, prompt in enumerate(ROWS):
            n = int(c.lengths[i])
            tokens = c.ids[i, :n]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor(prompt + tokens.tolist())[None], use_cache=False).logits[0]
            filtered = filter_logits(logits[len(prompt) - 1:-1].float() / sampling.temperature, sampling.top_k,
                                     sampling.top_p)
            want = filtered.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
            torch.testing.assert_close(c.logps[i, :n], want, atol=2e-5, rtol=0)
            assert c.logps[i, n:].eq(0).all()


WORKER = textwrap.dedent("""
    import functools, json, sys
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    sys.path.insert(0, sys.argv[3])  # tests/, for its helpers
    from helpers.compaction import CPU, KEYS, MAX, PAD, ROWS, model_and_eos
    from helpers.workers import each_strategy
    from llmtrain.rollout.local import Sampling, generate

    def run(strategy, out, rank):
        model, eos = model_and_eos()
        # Rank 0 gets the rows that stop first, rank 1 those that run to MAX.
        order = generate(model, ROWS, KEYS, Sampling(MAX), eos, PAD, CPU).lengths.argsort(stable=True).tolist()
        mine = order[:4] if rank == 0 else order[-4:]
        if strategy == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model, reshard_after_forward=False)
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
            model = FullyShardedDataParallel(model, auto_wrap_policy=functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}), use_orig_params=True,
                device_id=CPU)
        forwards = []
        model.register_forward_hook(lambda m, a, k, o: forwards.append(k["input_ids"].shape[0]), with_kwargs=True)
        got = generate(model, [ROWS[i] for i in mine], [KEYS[i] for i in mine], Sampling(MAX), eos, PAD, CPU)
        json.dump({"rows": mine, "completions": [r[:n].tolist() for r, n in zip(got.ids, got.lengths)],
                   "forwards": forwards}, open(f"{out}/{strategy}-{rank}.json", "w"))

    each_strategy(run)  # each on a fresh model
""")


@pytest.fixture(scope="module")
def stopped_rank(tmp_path_factory):
    """The worker's files, rank by rank, for FSDP1 and FSDP2."""
    return run_strategies(WORKER, STRATEGIES, tmp_path_factory.mktemp("stopped_rank"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rank_whose_rows_all_stopped(stopped_rank, strategy):
    """FSDP1 (lockstep): the rank whose rows all stopped feeds one padding row for as many forwards as the
    other runs; FSDP2: it stops at its own last token. Both: batches shrink and the completions are the
    unwrapped process's."""
    model, eos = model_and_eos()
    want = generate(model, ROWS, KEYS, Sampling(MAX), eos, PAD, CPU)
    ranks = [json.loads((stopped_rank / f"{strategy}-{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["completions"] == [want.ids[i, :want.lengths[i]].tolist() for i in r["rows"]]
    early, late = (r["forwards"] for r in ranks)
    assert late == [4] * MAX  # rank 1's rows all run to MAX
    assert early[0] == 4 and early[-1] == 1 and early == sorted(early, reverse=True)  # rows leave the batch
    stopped = int(max(want.lengths[i] for i in ranks[0]["rows"]))
    assert stopped < MAX
    assert len(early) == (MAX if strategy == "fsdp" else stopped)
