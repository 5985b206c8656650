"""Data: masks token by token, packing isolation (logits), the global order, streaming that never
hangs, exact resume of the data position, bad records, and the inspect CLI."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from helpers import REPO, TINY
from helpers.procs import launch, read_metrics, run_recipe
from llmtrain.config import ConfigError, DataConfig, load_config
from llmtrain.data import IGNORE, GlobalOrderSampler, StreamingRows, StreamSteps, build
from llmtrain.data.formats import BadRecord, encode_chat, encode_instruction, encode_text
from llmtrain.data.packing import to_rows
from llmtrain.models import attention
from llmtrain.models import hf as model_lib

TOKENIZER = REPO / "assets" / "tokenizer"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def trained_text(tok, ids, labels) -> list[str]:
    """Decoded runs of consecutive trained tokens."""
    runs, cur = [], []
    for i, label in zip(ids, labels):
        if label != IGNORE:
            assert label == i
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Add 2 and 3."},
                     {"role": "assistant", "content": "5"},
                     {"role": "user", "content": "And 4 and 4?"},
                     {"role": "assistant", "content": "Eight, that is 8."}]}


def test_chat_trains_only_assistant_turns(tok):
    ids, labels = encode_chat(CHAT, DataConfig(), tok)
    assert trained_text(tok, ids, labels) == ["5<|eot_id|>", "Eight, that is 8.<|eot_id|>"]
    assert tok.decode(ids).startswith("<|begin_of_text|><|start_header_id|>system")
    _, all_labels = encode_chat(CHAT, DataConfig(train_on_prompt=True), tok)
    assert all(label != IGNORE for label in all_labels)


def test_template_without_generation_markers_gives_the_same_labels(tok):
    """Llama-3-style templates have no {% generation %}: the labels then come from locating each
    assistant message in the rendered text, and must equal the marked template's."""
    plain = AutoTokenizer.from_pretrained(TOKENIZER)
    plain.chat_template = tok.chat_template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    assert "{%- generation" not in plain.chat_template
    assert encode_chat(CHAT, DataConfig(), plain) == encode_chat(CHAT, DataConfig(), tok)


def test_sharegpt_maps_onto_messages(tok):
    share = {"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                "value": m["content"]} for m in CHAT["messages"]]}
    assert encode_chat(share, DataConfig(), tok) == encode_chat(CHAT, DataConfig(), tok)


def test_chat_truncation_keeps_masks_aligned(tok):
    ids, labels = encode_chat(CHAT, DataConfig(), tok)
    rows, truncated = to_rows([(ids, labels, False)], 30, tok.pad_token_id, packing=False)
    assert truncated == 1
    row_ids, row_labels = rows["input_ids"][0], rows["labels"][0]
    assert row_ids == ids[:30]
    assert row_labels[1:] == labels[1:30]


def test_instruction_masks_the_prompt(tok):
    record = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    ids, labels = encode_instruction(record, DataConfig(), tok)
    assert trained_text(tok, ids, labels) == ["5<|end_of_text|>"]
    assert "### Input:\n2 and 3" in tok.decode(ids)
    ids, labels = encode_instruction({"instruction": "Say hi.", "output": "hi"}, DataConfig(train_on_prompt=True), tok)
    assert "### Input" not in tok.decode(ids) and labels == ids


@pytest.mark.parametrize("record,reason", [
    ({"messages": []}, "empty conversation"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "unknown role"),
    ({"other": 1}, "no 'messages'"),
])
def test_bad_chat_records_say_why(tok, record, reason):
    with pytest.raises(BadRecord, match=reason):
        encode_chat(record, DataConfig(), tok)


def test_text_and_default_chat_template(tok):
    ids, labels = encode_text({"text": "the red ball"}, DataConfig(), tok)
    assert ids[-1] == tok.eos_token_id and labels == ids
    bare = AutoTokenizer.from_pretrained(TOKENIZER)
    bare.chat_template = None
    from llmtrain.data.formats import prepare_tokenizer

    prepare_tokenizer(bare, {"chat"})
    ids, labels = encode_chat(CHAT, DataConfig(), bare)
    assert trained_text(bare, ids, labels) == ["5<|end_of_text|>", "Eight, that is 8.<|end_of_text|>"]


def small_llama(tok, attn: str) -> LlamaForCausalLM:
    """A 2-layer GQA Llama with a fixed init, whatever the attention implementation."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, attn_implementation=attn))


@pytest.mark.parametrize("attn", ["sdpa", "eager", attention.NAME])
def test_packed_document_sees_only_itself(tok, attn):
    model = small_llama(tok, attn).eval()
    a = tok("the red ball is here")["input_ids"]
    b = tok("three plus four is seven")["input_ids"]
    rows, _ = to_rows([(a, a, True), (b, b, True)], 40, tok.pad_token_id, packing=True)
    row = {k: torch.tensor(v) for k, v in rows.items()}
    assert row["position_ids"][0, len(a)] == 0  # b restarts its positions
    assert row["labels"][0, len(a)] == IGNORE  # and its first token is not predicted from a
    with torch.no_grad():
        # use_cache=False, as in training: with a cache, transformers ignores packed position_ids
        packed = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits[0]
        alone_a = model(input_ids=torch.tensor([a])).logits[0]
        alone_b = model(input_ids=torch.tensor([b])).logits[0]
    torch.testing.assert_close(packed[:len(a)], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[len(a):len(a) + len(b)], alone_b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("long_rows", [4096, 20])  # 37 positions: 4 query chunks; past 20: by example (long rows)
def test_chunked_sdpa_matches_sdpa_on_packed_rows(tok, monkeypatch, long_rows):
    """The query chunks of llmtrain's sdpa give transformers' sdpa numbers, forward and backward."""
    monkeypatch.setattr(attention, "LONG_ROWS", long_rows)
    texts = ["the red ball is here", "three plus four is seven", "a cat", "the blue box is big and red"]
    examples = [(ids, ids, True) for ids in (tok(t)["input_ids"] for t in texts * 3)]
    rows, _ = to_rows(examples, 37, tok.pad_token_id, packing=True)  # 37: uneven chunks
    batch = {k: torch.tensor(v) for k, v in rows.items()}
    assert len(batch["input_ids"]) > 1 and (batch["position_ids"][:, 1:] == 0).any()
    grads, logits = [], []
    for attn in ["sdpa", attention.NAME]:
        model = small_llama(tok, attn)
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        out.square().sum().backward()
        logits.append(out.detach())
        grads.append([p.grad for p in model.parameters()])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-6, rtol=1e-6)
    for a, b in zip(*grads):  # key/value gradients are summed over the chunks: fp32 rounding only
        torch.testing.assert_close(b, a, atol=1e-6 * a.abs().max().item(), rtol=1e-5)
    # and it is what model.attn_implementation=sdpa (the default) builds
    cfg = load_config(TINY, [])
    assert cfg.model.attn_implementation == "sdpa"
    built = model_lib.build_meta_model(model_lib.load_model_config(cfg.model, tok), cfg.model)
    assert built.model.layers[0].self_attn.config._attn_implementation == attention.NAME


def test_long_packed_rows_keep_no_mask_for_the_backward_pass(tok, monkeypatch):
    """Given a mask, SDPA keeps an fp32 copy of it per layer for the backward pass (quadratic in the row); rows
    past LONG_ROWS are attended example by example under is_causal: nothing of [positions x positions]."""
    length = 48
    pos = torch.cat([torch.arange(n) for n in (20, 17, 11)])[None]
    ids = torch.randint(0, len(tok), (1, length), generator=torch.Generator().manual_seed(0))
    saved = []

    def forward_saves(long_rows: int) -> list[tuple]:
        monkeypatch.setattr(attention, "LONG_ROWS", long_rows)
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            small_llama(tok, attention.NAME)(input_ids=ids, position_ids=pos, use_cache=False)
        return [s for s in saved if len(s) == 4 and s[-1] > 8]  # [.., queries, keys], not [.., positions, head_dim 8]
    assert forward_saves(4096)  # 4 query chunks under masks: kept for the backward pass
    assert forward_saves(32) == []
    # nor is the whole [positions x positions] mask built: transformers gets an empty marker
    assert attention.long_rows_mask(1, length, length).shape == (1, 1, 0, 0)
    monkeypatch.setattr(attention, "LONG_ROWS", 4096)
    assert attention.long_rows_mask(1, length, length, allow_is_causal_skip=False).shape == (1, 1, length, length)


def positions(n: int, world: int, seed: int, start: int, count: int) -> list[list[int]]:
    """Each rank's first `count` indices."""
    out = []
    for rank in range(world):
        it = iter(GlobalOrderSampler(range(n), world, rank, seed, start=start))
        out.append([next(it) for _ in range(count)])
    return out


def test_global_order_reshuffles_epochs_and_splits_ranks_disjointly():
    (one,) = positions(10, 1, 3, 0, 30)
    epochs = [one[0:10], one[10:20], one[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # every epoch is a permutation
    assert epochs[0] != epochs[1] != epochs[2]  # and a new one each time
    r0, r1 = positions(10, 2, 3, 0, 10)
    assert not set(r0[:5]) & set(r1[:5]) and sorted(r0[:5] + r1[:5]) == sorted(epochs[0])
    # a global batch of 4 rows: the same set whatever the world size
    for k in range(5):
        assert sorted(one[4 * k:4 * k + 4]) == sorted(r0[2 * k:2 * k + 2] + r1[2 * k:2 * k + 2])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_mid_epoch_continues_the_same_sequence(world):
    """A run resumed at sample 6 (mid-epoch of 10) on any world size reads what the uninterrupted
    single-rank run reads next."""
    (full,) = positions(10, 1, 5, 0, 30)
    resumed = positions(10, world, 5, 6, 8)
    interleaved = [resumed[r][j] for j in range(8) for r in range(world)]
    assert interleaved == full[6:6 + 8 * world]


def test_bad_records_are_counted_or_fail_with_file_and_line(tmp_path, tok):
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"text": "good one"}, {"text": 3}, {"nope": "x"}, {"text": ""}, {"text": "another good one"}]) + "\n")
    built = build(DataConfig(path=str(path), seq_len=16), tok, seed=0)
    assert built.stats.num_examples == 2 and built.stats.skipped == 3
    assert "not text" in built.stats.summary()
    with pytest.raises(ConfigError, match=r"mixed.jsonl, line 2: field 'text' is int, not text"):
        build(DataConfig(path=str(path), seq_len=16, strict=True), tok, seed=0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(ConfigError, match="yields no rows"):
        build(DataConfig(path=str(empty), seq_len=16), tok, seed=0)


def test_summary_counts_in_words_and_names_the_first_truncated_pair(tmp_path, tok):
    short = {"prompt": "Say hi.", "chosen": " Hi.", "rejected": " No."}
    long = {"prompt": "One two three. " * 20, "chosen": " Four.", "rejected": " Six."}  # the prompt is cut
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [short, {"prompt": "x"}, long]) + "\n")
    stats = build(DataConfig(path=str(path), format="preference", seq_len=40), tok, seed=0).stats
    assert (stats.num_examples, stats.skipped, stats.truncated) == (2, 1, 1)
    reason = "field 'chosen' is missing, not text or a list of messages"
    assert stats.summary() == (f"2 examples, 1 bad record skipped: {reason} (1); the first at {path}, line 2: "
                               f"{reason}, 1 truncated to data.seq_len; the first at {path}, line 3")
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"document {i}"}) for i in range(10)) + "\n")
    stats = build(DataConfig(path=str(text), seq_len=16, val_fraction=0.2), tok, seed=0).stats
    assert stats.summary() == "8 examples (and 2 held out for validation)"
    text.write_text(json.dumps({"text": "one document"}) + "\n")
    assert build(DataConfig(path=str(text), seq_len=16), tok, seed=0).stats.summary() == "1 example"
    text.write_text("\n".join(json.dumps({"text": t}) for t in ("short", "a long document " * 20)) + "\n")
    stats = build(DataConfig(path=str(text), seq_len=16, packing=False), tok, seed=0).stats
    assert stats.summary() == f"2 examples, 1 truncated to data.seq_len; the first at {text}, line 2"


def test_streaming_resume_at_same_world_size_is_exact(tok, single_process_group):
    section = DataConfig(path=str(REPO / "data" / "demo" / "val.jsonl"), seq_len=32, streaming=True,
                         shuffle_buffer=50)
    steps = StreamSteps(StreamingRows(section, tok, 0, 0, 1), 2, 2, torch.device("cpu"), {}, 1)
    seen = [next(steps) for _ in range(3)]
    position = steps.position()
    after = [next(steps) for _ in range(3)]
    resumed = StreamSteps(StreamingRows(section, tok, 0, 0, 1), 2, 2, torch.device("cpu"), position, 1)
    again = [next(resumed) for _ in range(3)]
    for a, b in zip(after, again):
        for ma, mb in zip(a, b):
            assert torch.equal(ma["input_ids"], mb["input_ids"])
    assert not torch.equal(seen[0][0]["input_ids"], after[0][0]["input_ids"])


@pytest.mark.slow
def test_streaming_uneven_shards_finish_on_every_rank(tmp_path):
    """One small file, 2 ranks (more ranks than files), an odd number of documents: the ranks wrap to
    new epochs together and the run ends normally, several epochs in."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " + "word " * (5 + 7 * i)}) + "\n" for i in range(7)))
    run_recipe(tmp_path / "out", "parallel.strategy=ddp", f"data.path={path}", "data.streaming=true",
               "data.seq_len=32", "train.micro_batch_size=2", "train.max_steps=12", nproc=2, timeout=180)
    assert [r["step"] for r in read_metrics(tmp_path / "out")][-1] == 12


@pytest.mark.slow
def test_chat_run_with_validation_logs_val_loss(tmp_path):
    run_recipe(tmp_path, "parallel.strategy=fsdp2", "data.path=data/demo/chat.jsonl", "data.format=chat",
               "data.seq_len=128", "model.config.max_position_embeddings=128", "data.val_fraction=0.05",
               "eval.every_steps=2", "train.micro_batch_size=2", nproc=2)
    vals = [r for r in read_metrics(tmp_path) if "val_loss" in r]
    assert [r["step"] for r in vals] == [2, 4]
    assert all(5 < r["val_loss"] < 7 and r["val_ppl"] > 1 for r in vals)


@pytest.mark.slow
def test_inspect_cli_json(tmp_path):
    res = launch(["-m", "llmtrain.data", "--config", TINY, "--json", "--n", "2", "data.path=data/demo/instruct.jsonl",
                  "data.format=instruction", "data.seq_len=128"], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert {"samples", "num_examples", "num_tokens", "trained_tokens", "packing_efficiency", "skipped"} <= out.keys()
    assert out["num_examples"] == 600 and len(out["samples"]) == 2
    assert 0.5 < out["packing_efficiency"] <= 1 and 0 < out["trained_tokens"] < out["num_tokens"]
    assert "[[" in out["samples"][0]["text"]


def test_config_rejects_missing_validation_for_eval():
    with pytest.raises(ConfigError, match="eval.every_steps needs validation data"):
        load_config(TINY, ["eval.every_steps=2"])
