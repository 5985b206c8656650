"""Preference data and losses: encoding of both record forms (labels only on responses, the truncation
rule, bad records), the collate layout, every loss and metric against the published formulas written
out here, and one global-batch loss whatever the split into micro-batches."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from helpers import REPO, TINY
from helpers.pairs import assert_splits_match_the_whole_batch, logsig, plain_logps, random_batch, tiny_model
from llmtrain.config import ConfigError, DataConfig, load_config
from llmtrain.data.formats import DEFAULT_CHAT_TEMPLATE, IGNORE, BadRecord, prepare_tokenizer
from llmtrain.data.preference import Pair, collate_pairs, encode_preference, truncate
from llmtrain.losses import preference as pl
from llmtrain.recipes import RECIPES

TOKENIZER = REPO / "assets" / "tokenizer"
BOS, EOS, EOT = 0, 1, 5
SECTION = DataConfig(seq_len=64)
USER = {"role": "user", "content": "What colour is the ball?"}
SYSTEM = {"role": "system", "content": "Answer briefly."}
GOOD = {"role": "assistant", "content": "The ball is red."}
BAD = {"role": "assistant", "content": "The ball is blue."}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def trained(tok, batch, row) -> str:
    """The decoded tokens of one row that carry a label (checking each label is its token)."""
    ids, labels = batch["input_ids"][row], batch["labels"][row]
    assert torch.equal(labels[labels != IGNORE], ids[labels != IGNORE])
    return tok.decode(ids[labels != IGNORE])


def test_text_pairs_train_only_the_responses_plus_eos(tok):
    record = {"prompt": "Anna has two cups. She buys one more.", "chosen": " Now she has three cups.",
              "rejected": " Now she has four cups."}
    pair = encode_preference(record, SECTION, tok)
    assert pair.prompt == tok(record["prompt"])["input_ids"] and not pair.truncated
    batch = collate_pairs([pair], tok.pad_token_id)
    assert trained(tok, batch, 0) == " Now she has three cups.<|end_of_text|>"
    assert trained(tok, batch, 1) == " Now she has four cups.<|end_of_text|>"
    assert tok.decode(batch["input_ids"][0]) == record["prompt"] + trained(tok, batch, 0)


def test_message_pairs_apply_the_chat_template_and_share_an_implicit_prompt(tok):
    explicit = encode_preference({"prompt": [SYSTEM, USER], "chosen": [GOOD], "rejected": [BAD]}, SECTION, tok)
    implicit = encode_preference({"chosen": [SYSTEM, USER, GOOD], "rejected": [SYSTEM, USER, BAD]}, SECTION, tok)
    assert explicit == implicit
    assert tok.decode(explicit.prompt) == tok.apply_chat_template([SYSTEM, USER], tokenize=False,
                                                                  add_generation_prompt=True)
    batch = collate_pairs([explicit], tok.pad_token_id)
    assert [trained(tok, batch, row) for row in (0, 1)] == ["The ball is red.<|eot_id|>", "The ball is blue.<|eot_id|>"]


def test_a_tokenizer_without_a_template_gets_the_default_one(tok):
    plain = AutoTokenizer.from_pretrained(TOKENIZER)
    plain.chat_template = None
    prepare_tokenizer(plain, {"preference"})
    assert plain.chat_template == DEFAULT_CHAT_TEMPLATE
    pair = encode_preference({"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}, SECTION, plain)
    assert tok.decode(pair.chosen) == "The ball is red.<|end_of_text|>"


def test_a_template_that_refuses_a_conversation_gives_a_bad_record(tok):
    strict = AutoTokenizer.from_pretrained(TOKENIZER)  # like Gemma 2 and Mistral: no system role
    strict.chat_template = ("{%- if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}"
                            "{%- endif %}" + tok.chat_template)
    with pytest.raises(BadRecord, match="the chat template refuses this conversation: no system role"):
        encode_preference({"prompt": [SYSTEM, USER], "chosen": [GOOD], "rejected": [BAD]}, SECTION, strict)


def test_truncation_cuts_the_prompt_from_the_left_then_the_responses_from_the_right():
    prompt = [BOS, *range(10, 20)]  # 11 tokens
    # Fits: nothing changes.
    assert truncate(prompt, [7, 8], [9], 13, BOS) == Pair(prompt, [7, 8], [9], False)
    # Only the prompt is cut, from the left and only as much as needed; BOS stays.
    assert truncate(prompt, [7, 8, 9], [9], 12, BOS) == Pair([BOS, *range(12, 20)], [7, 8, 9], [9], True)
    # The prompt keeps at least half of seq_len (BOS included), then the responses lose their ends.
    long_c, long_r = list(range(100, 120)), list(range(200, 205))
    assert truncate(prompt, long_c, long_r, 12, BOS) == Pair([BOS, *range(15, 20)], long_c[:6], long_r[:6], True)
    # A short prompt is kept whole.
    assert truncate([BOS, 10], long_c, long_r, 12, BOS) == Pair([BOS, 10], long_c[:10], long_r[:10], True)
    with pytest.raises(BadRecord, match="differ only beyond data.seq_len"):
        truncate(prompt, [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8], 12, BOS)


def test_long_pairs_are_truncated_and_kept(tok):
    record = {"prompt": "One two three. " * 20, "chosen": " Four five six." * 20, "rejected": " Six five four." * 20}
    pair = encode_preference(record, DataConfig(seq_len=40), tok)
    assert pair.truncated and len(pair.prompt) == 20
    assert len(pair.prompt) + len(pair.chosen) == len(pair.prompt) + len(pair.rejected) == 40
    assert pair.prompt == tok(record["prompt"])["input_ids"][-20:]


@pytest.mark.parametrize("record, reason", [
    ({"chosen": " a", "rejected": " b"}, "field 'prompt' is missing"),
    ({"prompt": "p", "rejected": " b"}, "field 'chosen' is missing"),
    ({"prompt": "p", "chosen": " a", "rejected": 3}, "field 'rejected' is int"),
    ({"prompt": "p", "chosen": " a", "rejected": " a"}, "identical"),
    ({"prompt": "p", "chosen": "  ", "rejected": " b"}, "empty 'chosen'"),
    ({"prompt": "", "chosen": " a", "rejected": " b"}, "the prompt has no tokens"),
    ({"prompt": "p", "chosen": [GOOD], "rejected": [BAD]}, "make it a list of messages"),
    ({"prompt": [USER], "chosen": [GOOD], "rejected": " b"}, "use one form"),
    ({"chosen": [GOOD], "rejected": [BAD]}, "share no leading turn"),
    ({"chosen": [USER, GOOD], "rejected": [USER]}, "'rejected' has no turn after the prompt"),
    ({"prompt": [USER], "chosen": [USER, GOOD], "rejected": [BAD]}, "starts with a user turn"),
    ({"prompt": [USER], "chosen": [{"role": "assistant", "content": " "}], "rejected": [BAD]}, "empty 'chosen'"),
    ({"prompt": [{"role": "robot", "content": "x"}], "chosen": [GOOD], "rejected": [BAD]}, "unknown role"),
    ({"prompt": [USER], "chosen": [GOOD], "rejected": [GOOD]}, "identical"),
])
def test_bad_records_name_the_reason(tok, record, reason):
    with pytest.raises(BadRecord, match=reason):
        encode_preference(record, SECTION, tok)


def test_collate_puts_chosen_rows_then_rejected_rows():
    pairs = [Pair([BOS, 10], [11, 12, 13], [14], False), Pair([BOS, 20, 21, 22], [23], [24, 25], False)]
    batch = collate_pairs(pairs, pad_id=2)
    P = 2
    assert batch["input_ids"].tolist() == [[BOS, 10, 11, 12, 13, P], [BOS, 20, 21, 22, 23, P],
                                           [BOS, 10, 14, P, P, P], [BOS, 20, 21, 22, 24, 25]]
    I = IGNORE  # noqa: E741  (one letter keeps the label grid below aligned)
    assert batch["labels"].tolist() == [[I, I, 11, 12, 13, I], [I, I, I, I, 23, I],
                                        [I, I, 14, I, I, I], [I, I, I, I, 24, 25]]
    assert batch["position_ids"].tolist() == [list(range(6))] * 4
    assert pl.pair_counts(batch["labels"]).tolist() == [2, 4]


# ----------------------------------------------------------------------------- losses


def published(loss, beta, eps, gamma, pi, ref, n):
    """Per pair: (loss, chosen reward, rejected reward, logps/chosen, logps/rejected), from the papers."""
    out = []
    B = len(pi) // 2
    for i in range(B):
        pc, pr, nc, nr = pi[i], pi[B + i], n[i], n[B + i]
        if loss == "simpo":  # SimPO eq. 6; label smoothing as TRL's CPOTrainer
            ac, ar = pc / nc, pr / nr
            z = beta * ac - beta * ar - gamma
            out.append((-(1 - eps) * logsig(z) - eps * logsig(-z), beta * ac, beta * ar, ac, ar))
            continue
        dc, dr = pc - ref[i], pr - ref[B + i]
        if loss == "sigmoid":  # DPO eq. 7; cDPO: the label flipped with probability eps
            z = beta * (dc - dr)
            value = -(1 - eps) * logsig(z) - eps * logsig(-z)
        else:  # IPO eq. 17 on per-token log-ratios
            value = (dc / nc - dr / nr - 1 / (2 * beta)) ** 2
        out.append((value, beta * dc, beta * dr, pc, pr))
    return out


CASES = [("sigmoid", 0.1, 0.0, 0.0, 0.0), ("sigmoid", 0.5, 0.2, 0.0, 0.3), ("ipo", 0.3, 0.0, 0.0, 0.0),
         ("simpo", 2.0, 0.0, 0.7, 0.0), ("simpo", 2.5, 0.1, 1.2, 0.5)]


@pytest.mark.parametrize("loss, beta, eps, gamma, sft", CASES)
def test_losses_and_metrics_equal_the_published_formulas(loss, beta, eps, gamma, sft):
    logits, ref_logits, labels = random_batch(seed=1)
    logps, lengths = pl.sequence_logps(pl.token_logps(logits, labels), labels)
    ref = None if loss == "simpo" else pl.sequence_logps(pl.token_logps(ref_logits, labels), labels)[0]
    sums = pl.preference_sums(logps, lengths, ref, loss, beta, eps, gamma)
    value = pl.objective(sums, pl.pair_counts(labels), sft).item()
    got = pl.metrics(sums.metrics, labels.shape[0] // 2)

    pi, n = plain_logps(logits, labels)
    ref_plain = plain_logps(ref_logits, labels)[0]
    assert torch.allclose(logps.double(), torch.tensor(pi, dtype=torch.float64), atol=1e-5)
    rows = published(loss, beta, eps, gamma, pi, ref_plain, n)
    B = len(rows)
    chosen_nll = -sum(pi[:B]) / sum(n[:B])  # the SFT term: mean NLL over every chosen response token
    assert value == pytest.approx(sum(r[0] for r in rows) / B + sft * chosen_nll, rel=1e-5, abs=1e-5)
    want = {"rewards/chosen": sum(r[1] for r in rows) / B, "rewards/rejected": sum(r[2] for r in rows) / B,
            "rewards/accuracies": sum(r[1] > r[2] for r in rows) / B,
            "rewards/margins": sum(r[1] - r[2] for r in rows) / B,
            "logps/chosen": sum(r[3] for r in rows) / B, "logps/rejected": sum(r[4] for r in rows) / B}
    assert set(got) == set(want)
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-5), name
    assert 0 < want["rewards/accuracies"] < 1  # the batch exercises both outcomes


@pytest.mark.parametrize("loss, beta, eps, gamma, sft", [CASES[1], CASES[2], CASES[4]])
def test_any_split_gives_the_loss_metrics_and_gradients_of_the_whole_batch(tok, loss, beta, eps, gamma, sft):
    """One batch of 6 pairs, then the same pairs as micro-batches of 1, 2 and 3 pairs (accumulated as
    ranks and accumulation steps would be): the sums over micro-batches equal the whole batch's."""
    records = [json.loads(line) for line in (REPO / "data" / "demo" / "preference.jsonl").open()][:6]
    pairs = [encode_preference(r, SECTION, tok) for r in records]
    policy, reference = tiny_model(0), tiny_model(1).requires_grad_(False)

    def run(splits):
        batches = [collate_pairs(pairs[a:b], tok.pad_token_id) for a, b in splits]
        totals = sum(pl.pair_counts(b["labels"]) for b in batches)
        policy.zero_grad()
        value, summed = 0.0, torch.zeros(len(pl.METRICS))
        for batch in batches:
            inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
            labels = batch["labels"]
            logps, lengths = pl.sequence_logps(pl.token_logps(policy(**inputs).logits, labels), labels)
            ref = None if loss == "simpo" else pl.sequence_logps(pl.token_logps(reference(**inputs).logits, labels),
                                                                 labels)[0]
            sums = pl.preference_sums(logps, lengths, ref, loss, beta, eps, gamma)
            share = pl.objective(sums, totals, sft)
            share.backward()
            value += share.item()
            summed += sums.metrics
        return value, pl.metrics(summed, int(totals[0])), [p.grad.clone() for p in policy.parameters()]

    assert_splits_match_the_whole_batch(run)


def test_loss_settings_are_checked_naming_the_key():
    """Combinations of dpo.* keys; each key's range is load_config's (tests/config/test_config.py)."""
    pl.check_settings("simpo", 0.1, 0.5, False)
    pl.check_settings("ipo", 0.0, 0.0, True)
    with pytest.raises(ConfigError, match="dpo.loss"):  # a choice of the Literal: load_config's
        load_config(TINY, ["dpo.loss=dpo"], RECIPES["dpo"].config_cls)
    for args, key in [(("ipo", 0.1, 0.0), "dpo.label_smoothing"), (("sigmoid", 0.0, 0.5), "dpo.gamma")]:
        with pytest.raises(ConfigError, match=key):
            pl.check_settings(*args, False)
    with pytest.raises(ConfigError, match="dpo.precompute_reference"):  # simpo has no reference
        pl.check_settings("simpo", 0.0, 0.0, True)
