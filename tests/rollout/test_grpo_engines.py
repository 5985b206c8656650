"""rollout.engine: the vLLM glue of llmtrain.rollout.vllm against a fake vLLM (no vllm installed: RequestOutput-
shaped answers from an LLM.generate stand-in): one request per row with its key's seed, the sampling
parameters and EOS ids as stop tokens; the answers read back as Completions with the sampled tokens' log-probs,
cut after the first EOS, truncation flagged, and reproducible by key whatever the batch (the vLLM engine around
this glue and rollout.engine's set-up checks: test_grpo_vllm.py). The transformers engine (a real 1-rank gloo
group): it samples with the weights pushed into it (export.hf_state of a trainer model), its log-probs are the
trainer's filtered distribution's (temperature, top-k, top-p) to 1e-5, the same rows give the same completions;
the weight-sync fingerprint (llmtrain.rollout.sync) of its copy equals the trainer's after a push, and one stale
parameter stops the step with one line naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from transformers import LlamaConfig, LlamaForCausalLM

from helpers.engines import stale_copy_is_caught
from llmtrain.export import hf_state
from llmtrain.parallelize import STRATEGIES
from llmtrain.rollout import sync
from llmtrain.rollout.engine import EngineSetup
from llmtrain.rollout.section import RolloutSection
from llmtrain.rollout.transformers import TransformersEngine
from llmtrain.rollout.local import Sampling, filter_logits, sample_seed
from llmtrain.rollout.rows import training_rows
from llmtrain.rollout.vllm import from_vllm, vllm_requests
from llmtrain.losses import policy

EOS, PAD, VOCAB = [2, 3], 0, 24


class FakeLLM:
    """vllm.LLM.generate's contract: each request's tokens from its own seed (uniform over VOCAB, every
    token's log-prob log(1/VOCAB) + a per-position offset), stopping at a stop token (kept) or max_tokens."""

    def generate(self, prompts: list[dict], params: list[dict]) -> list:
        out = []
        for prompt, p in zip(prompts, params):
            g = torch.Generator().manual_seed(p["seed"])
            ids, logprobs = [], []
            for t in range(p["max_tokens"]):
                token = int(torch.randint(1, VOCAB, (1,), generator=g))
                ids.append(token)
                logprobs.append({token: SimpleNamespace(logprob=-2.5 - 0.01 * t, rank=1)})
                if token in p["stop_token_ids"]:
                    break
            reason = "stop" if ids[-1] in p["stop_token_ids"] else "length"
            out.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[SimpleNamespace(
                token_ids=tuple(ids), logprobs=logprobs if p["logprobs"] is not None else None,
                finish_reason=reason)]))
        return out


PROMPTS = [[1, 4, 6], [1, 5], [1, 7, 9, 11]]
ROWS = [p for p in PROMPTS for _ in range(2)]
KEYS = [(5, 0, i // 2, i % 2) for i in range(len(ROWS))]
SAMPLING = Sampling(max_tokens=10, temperature=0.8, top_p=0.9, top_k=0)


def sample(rows, keys, sampling=SAMPLING):
    requests = vllm_requests(rows, keys, sampling, EOS)
    return requests, from_vllm(FakeLLM().generate(*map(list, zip(*requests))), EOS, PAD)


def test_requests_carry_the_rows_keys_and_sampling():
    requests, _ = sample(ROWS, KEYS)
    assert [r["prompt_token_ids"] for r, _ in requests] == ROWS
    params = [p for _, p in requests]
    assert [p["seed"] for p in params] == [sample_seed(*k) for k in KEYS] and len({p["seed"] for p in params}) == 6
    assert {(p["n"], p["temperature"], p["top_p"], p["top_k"], p["max_tokens"], p["logprobs"],
             tuple(p["stop_token_ids"])) for p in params} == {(1, 0.8, 0.9, -1, 10, 0, (2, 3))}  # top_k 0: -1
    assert vllm_requests(ROWS[:1], KEYS[:1], Sampling(4, top_k=5), EOS)[0][1]["top_k"] == 5


def test_answers_read_back_as_completions_with_logprobs():
    _, c = sample(ROWS, KEYS)
    raw = FakeLLM().generate(*map(list, zip(*vllm_requests(ROWS, KEYS, SAMPLING, EOS))))
    assert c.truncated.any() and not c.truncated.all()
    for i, request in enumerate(raw):
        out = request.outputs[0]
        n = int(c.lengths[i])
        assert c.ids[i, :n].tolist() == list(out.token_ids) and c.ids[i, n:].eq(PAD).all()
        assert bool(c.truncated[i]) == (out.finish_reason == "length") == (out.token_ids[-1] not in EOS)
        assert c.mask[i].tolist() == [True] * n + [False] * (c.ids.shape[1] - n)
        assert torch.allclose(c.logps[i, :n], torch.tensor([-2.5 - 0.01 * t for t in range(n)]))
        assert c.logps[i, n:].eq(0).all()
    # The same keys in another batch and order: the same completions (vLLM seeds each request).
    _, alone = sample(ROWS[3:4], KEYS[3:4])
    assert alone.ids[0, :alone.lengths[0]].tolist() == c.ids[3, :c.lengths[3]].tolist()


def test_engine_logprobs_reach_the_drift_guard_on_the_trained_tokens():
    """training_rows' trained tokens line up with the engine's log-probs (to_grid), as recipes/grpo.py lays
    them out: an engine agreeing with the trainer gives ratio 1, one off by 0.1 nats exp(0.1)."""
    _, c = sample(ROWS, KEYS)
    rows = training_rows(ROWS, c, PAD, mask_truncated=False)
    keep = torch.cat([rows["labels"][:, 1:] != -100, torch.zeros(len(ROWS), 1, dtype=torch.bool)], 1)
    engine = policy.to_grid(c.logps[c.mask], keep)
    sums = policy.policy_sums(engine + 0.1, keep, torch.ones(len(ROWS)), None, None, "dapo", 0.2, None, 0.0,
                              engine_logps=engine, correction="tis", cap=2.0)
    got = policy.drift_metrics(sums.drift, sums.drift_minima)
    assert got["sampling/logprob_diff/max"] == pytest.approx(0.1, abs=1e-5)
    assert got["sampling/importance_ratio/mean"] == pytest.approx(torch.tensor(0.1).exp().item(), rel=1e-5)


def test_answers_without_logprobs_are_refused():
    requests = vllm_requests(ROWS, KEYS, SAMPLING, EOS)
    raw = FakeLLM().generate([r for r, _ in requests], [{**p, "logprobs": None} for _, p in requests])
    with pytest.raises(ValueError, match="logprobs=0"):
        from_vllm(raw, EOS, PAD)


CPU = torch.device("cpu")


def trainer_and_engine() -> tuple[LlamaForCausalLM, TransformersEngine]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    setup = EngineSetup(None, config, None, EOS, PAD, CPU, 64, len(ROWS), 7, torch.float32, "unused")
    return LlamaForCausalLM(config), TransformersEngine(RolloutSection(), setup)


def push(trainer, engine, step: int) -> dict[str, float]:
    """What llmtrain.rollout.sync.WeightSync.push does: gather, push, fingerprint the trainer's weights."""
    full = hf_state(trainer, STRATEGIES["none"], CPU)
    engine.update_weights(step, full)
    return sync.trainer_fingerprint(full, 7, step, engine.weights_dtype)


def test_transformers_engine_samples_the_pushed_weights_with_their_logprobs(single_process_group):
    trainer, engine = trainer_and_engine()
    push(trainer, engine, 0)
    sampling = Sampling(max_tokens=10, temperature=0.8, top_p=0.9, top_k=12)
    out = engine.generate(ROWS, KEYS, sampling)
    assert out.truncated != [True] * len(ROWS) and out.truncated != [False] * len(ROWS)
    worst = 0.0
    for prompt, tokens, cut, logps in zip(ROWS, out.tokens, out.truncated, out.logps):
        assert len(tokens) == len(logps) and (tokens[-1] in EOS) != cut and not set(tokens[:-1]) & set(EOS)
        assert len(tokens) == sampling.max_tokens or not cut
        with torch.no_grad():  # the trainer's distribution each token was sampled from
            logits = trainer(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        dist = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p).log_softmax(-1)
        worst = max(worst, (dist.gather(1, torch.tensor(tokens)[:, None]).squeeze(1) - torch.tensor(logps)).abs().max())
    assert worst < 1e-5
    assert engine.generate(ROWS, KEYS, sampling).tokens == out.tokens  # seeded by the rows' keys


def test_weight_sync_fingerprint_catches_a_stale_engine(single_process_group):
    trainer, engine = trainer_and_engine()
    expected = push(trainer, engine, 0)
    assert len(expected) == sync.PARAMETERS and expected == engine.fingerprint(list(expected))
    sync.check(expected, engine.fingerprint(list(expected)), 0, "transformers")
    stale_copy_is_caught(trainer, engine, "transformers", 1e-3, 7)
