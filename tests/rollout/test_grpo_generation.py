"""llmtrain.rollout.local: a completion depends on its key, its prompt and the weights only (the same tokens in
other batch groupings and orders), stops at every EOS id with the EOS kept and the rest masked, flags
truncation, filters like transformers' top-k / top-p warpers, decodes greedily as model.generate does with
top_k=1; and 2 ranks under FSDP2, FSDP1 and DDP (gloo) sample what one unwrapped process samples, with
FSDP2 and DDP ranks free to run different numbers of forwards (no per-step collective) and the model
training normally afterwards."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from helpers.keyed_sampling import CPU, EOS, PAD, PROMPTS, SAMPLING, rows_and_keys, tiny
from helpers.procs import run_strategies
from llmtrain.data.formats import IGNORE
from llmtrain.rollout.local import CompletionGrid, Sampling, filter_logits, generate, pick, sample_seed
from llmtrain.rollout.rows import training_rows
from llmtrain.losses.token import next_token_targets

def as_lists(c) -> list[list[int]]:
    return [row[: n].tolist() for row, n in zip(c.ids, c.lengths)]


def test_completions_depend_on_the_key_not_the_batch():
    model = tiny()
    rows, keys = rows_and_keys()
    whole = as_lists(generate(model, rows, keys, SAMPLING, EOS, PAD, CPU))
    assert model.training  # left as it was
    # Other groupings (one row at a time, uneven chunks) and a reversed order give the same completions.
    singles = [as_lists(generate(model, [r], [k], SAMPLING, EOS, PAD, CPU))[0] for r, k in zip(rows, keys)]
    assert singles == whole
    chunks = [c for a, b in ((0, 3), (3, 4), (4, 10)) for c in as_lists(generate(model, rows[a:b], keys[a:b], SAMPLING,
                                                                                   EOS, PAD, CPU))]
    assert chunks == whole
    reverse = as_lists(generate(model, rows[::-1], keys[::-1], SAMPLING, EOS, PAD, CPU))[::-1]
    assert reverse == whole
    # Another step (or generation index) samples differently: the two of a group differ, and so do steps.
    other = as_lists(generate(model, rows, rows_and_keys(step=4)[1], SAMPLING, EOS, PAD, CPU))
    assert other != whole and any(whole[2 * i] != whole[2 * i + 1] for i in range(len(PROMPTS)))


def test_eos_kept_rest_masked_and_truncation_flagged():
    model = tiny()
    rows, keys = rows_and_keys()
    c = generate(model, rows, keys, SAMPLING, EOS, PAD, CPU)
    assert c.ids.shape == c.mask.shape and c.ids.shape[1] <= SAMPLING.max_tokens
    stopped_on = set()
    for ids, mask, n, truncated in zip(c.ids.tolist(), c.mask.tolist(), c.lengths.tolist(), c.truncated.tolist()):
        assert mask == [True] * n + [False] * (len(mask) - n)
        assert ids[n:] == [PAD] * (len(ids) - n)
        eos_at = [t for t, i in enumerate(ids[:n]) if i in EOS]
        if truncated:
            assert not eos_at and n == SAMPLING.max_tokens
        else:
            assert eos_at == [n - 1]  # the first EOS ends it and is kept
            stopped_on.add(ids[n - 1])
    assert c.truncated.any() and not c.truncated.all()
    assert stopped_on == set(EOS)  # both EOS ids stop a completion
    assert c.lengths.tolist() == c.mask.sum(1).tolist()


def test_filter_logits_matches_transformers_warpers():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    for top_k, top_p in [(5, 1.0), (0, 0.7), (8, 0.5), (0, 0.01), (40, 1.0)]:
        want = logits.clone()
        if top_k:
            want = TopKLogitsWarper(top_k)(None, want)
        if top_p < 1:
            want = TopPLogitsWarper(top_p)(None, want)
        got = filter_logits(logits, top_k, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (top_k, top_p)
        assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])
        assert (~torch.isinf(got)).sum(1).min() >= 1


def test_inverse_cdf_pick():
    logits = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).log()  # token 1 has probability 0
    for u, token in [(0.0, 0), (0.0999, 0), (0.1001, 2), (0.69, 2), (0.71, 3), (0.999, 3)]:
        assert pick(logits, torch.tensor([u], dtype=torch.float64)).item() == token, u
    assert sample_seed(7, 3, 1, 0) == sample_seed(7, 3, 1, 0) != sample_seed(7, 3, 0, 1)


def test_top_k_1_is_greedy_as_model_generate():
    model = tiny().eval()
    prompt = PROMPTS[2]
    c = generate(model, [prompt], [(0, 0, 0, 0)], Sampling(max_tokens=10, top_k=1), EOS, PAD, CPU)
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=EOS,
                        pad_token_id=PAD)[0, len(prompt):]
    assert c.ids[0, : c.lengths[0]].tolist() == hf[: c.lengths[0]].tolist()
    assert c.lengths[0] == len(hf) or hf[c.lengths[0]:].eq(PAD).all()


def test_training_rows():
    """prompt + completion right-padded; labels the completion with its EOS; a truncated one masked on request;
    the loss's per-token grid (next-token targets) lines up with the completion's tokens."""
    c = CompletionGrid(torch.tensor([[5, 2, 0], [6, 7, 8]]), torch.tensor([[1, 1, 0], [1, 1, 1]]).bool(),
                    torch.tensor([2, 3]), torch.tensor([False, True]))
    rows = training_rows([[1, 4, 6], [1, 9]], c, PAD, mask_truncated=False)
    assert rows["input_ids"].tolist() == [[1, 4, 6, 5, 2, 0], [1, 9, 6, 7, 8, 0]]
    assert rows["labels"].tolist() == [[IGNORE] * 3 + [5, 2, IGNORE], [IGNORE] * 2 + [6, 7, 8, IGNORE]]
    assert rows["position_ids"].tolist() == [list(range(6))] * 2
    keep = next_token_targets(rows["labels"]) != IGNORE
    assert rows["input_ids"][:, 1:][keep[:, :-1]].tolist() == [5, 2, 6, 7, 8]
    masked = training_rows([[1, 4, 6], [1, 9]], c, PAD, mask_truncated=True)
    assert masked["labels"][1].eq(IGNORE).all() and torch.equal(masked["labels"][0], rows["labels"][0])


WORKER = textwrap.dedent("""
    import functools, json, sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    sys.path.insert(0, sys.argv[3])  # tests/, for its helpers
    from helpers.keyed_sampling import EOS, PAD, SAMPLING, rows_and_keys, tiny
    from helpers.workers import each_strategy
    from llmtrain.rollout.local import gathered, generate

    def sample(strategy, out, rank):
        model, cpu = tiny(), torch.device("cpu")
        rows, keys = rows_and_keys()
        mine = slice(rank * 6, 10) if rank else slice(0, 6)  # uneven shares: 6 and 4 rows
        if strategy == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model, reshard_after_forward=False)  # as llmtrain keeps the root gathered
        elif strategy == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
            model = FullyShardedDataParallel(model, auto_wrap_policy=functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}), use_orig_params=True,
                device_id=cpu)
        elif strategy == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        got = generate(model, rows[mine], keys[mine], SAMPLING, EOS, PAD, cpu)
        with torch.no_grad(), gathered(model) as (module, lockstep):
            if not lockstep:  # no collective in a forward: rank 1 running 3 more must not hang
                for _ in range(1 + 3 * rank):
                    module(input_ids=torch.tensor([rows[0]]), use_cache=False)
        # training goes on: a forward and backward, collective under FSDP, then the same parameters everywhere
        model(input_ids=torch.tensor([rows[0]]), use_cache=False).logits.sum().backward()
        json.dump({"completions": [r[:n].tolist() for r, n in zip(got.ids, got.lengths)],
                   "truncated": got.truncated.tolist(), "lockstep": lockstep},
                  open(f"{out}/{strategy}-{rank}.json", "w"))

    each_strategy(sample)  # each on a fresh model
""")


STRATEGIES = ["fsdp2", "fsdp", "ddp"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_sample_what_one_unwrapped_process_samples(sampled, strategy):
    rows, keys = rows_and_keys()
    want = generate(tiny(), rows, keys, SAMPLING, EOS, PAD, CPU)
    ranks = [json.loads((sampled / f"{strategy}-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["completions"] + ranks[1]["completions"] == as_lists(want)
    assert ranks[0]["truncated"] + ranks[1]["truncated"] == want.truncated.tolist()
    assert ranks[0]["lockstep"] == (strategy == "fsdp")


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """The worker's files, rank by rank, for every strategy: one launch."""
    return run_strategies(WORKER, STRATEGIES, tmp_path_factory.mktemp("two_ranks"))
