"""The shipped demo data and tokenizer are valid, and scripts/make_demo_assets.py reproduces them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT / "assets" / "tokenizer"
DATA_DIR = ROOT / "data" / "demo"
SPECIALS = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|pad|>": 2,
            "<|start_header_id|>": 3, "<|end_header_id|>": 4, "<|eot_id|>": 5}

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is three plus four?"},
    {"role": "assistant", "content": "Three plus four is seven."},
    {"role": "user", "content": "Add the numbers.\n3 and 4"},
    {"role": "assistant", "content": " 7 (sieben, 七) 🙂"},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def read_jsonl(name):
    with open(DATA_DIR / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_tokenizer_vocab_and_special_tokens(tok):
    assert len(tok) == 512
    assert tok.model_max_length == 2048
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
    assert {t: tok.convert_tokens_to_ids(t) for t in SPECIALS} == SPECIALS
    # Each special token is one id, never split, even inside text.
    assert tok("a<|eot_id|>b")["input_ids"][1] == SPECIALS["<|eot_id|>"]


@pytest.mark.parametrize("text", [
    "Anna has three apples.",
    "  leading spaces, trailing\ttab\t\nand\r\nCRLF  ",
    "Grüße aus Köln! Ελληνικά, русский, 日本語, 한국어, emoji 🙂👍🏽, math ∑x², zero\u200bwidth",
    "",
])
def test_tokenizer_round_trips_without_adding_tokens(tok, text):
    ids = tok(text)["input_ids"]
    assert SPECIALS["<|begin_of_text|>"] not in ids and SPECIALS["<|end_of_text|>"] not in ids
    assert tok.decode(ids) == text


def test_chat_template_assistant_mask(tok):
    out = tok.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)

    # Expected: header tokens unmasked; content + <|eot_id|> masked exactly for assistant turns.
    def enc(s):
        return tok(s, add_special_tokens=False)["input_ids"]
    ids, mask = [SPECIALS["<|begin_of_text|>"]], [0]
    for m in CHAT:
        header = enc(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n")
        body = enc(m["content"]) + [SPECIALS["<|eot_id|>"]]
        ids += header + body
        mask += [0] * len(header) + [int(m["role"] == "assistant")] * len(body)
    assert out["input_ids"] == ids
    assert out["assistant_masks"] == mask

    text = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nWhat is three plus four?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_data_files_parse_with_expected_fields():
    for name, n in [("train.jsonl", 3000), ("val.jsonl", 200)]:
        recs = read_jsonl(name)
        assert len(recs) == n and all(list(r) == ["text"] and r["text"] for r in recs)

    recs = read_jsonl("instruct.jsonl")
    assert len(recs) == 600
    assert all(list(r) == ["instruction", "input", "output"] and r["instruction"] and r["output"] for r in recs)
    assert any(r["input"] == "" for r in recs) and any(r["input"] for r in recs)

    convs = [r["messages"] for r in read_jsonl("chat.jsonl")]
    assert len(convs) == 600
    for msgs in convs:
        roles = [m["role"] for m in msgs if m["role"] != "system"]
        assert roles and roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(set(m) == {"role", "content"} and m["content"] for m in msgs)
    assert any(m[0]["role"] == "system" for m in convs) and any(len(m) > 3 for m in convs)

    convs = [r["conversations"] for r in read_jsonl("sharegpt.jsonl")]
    assert len(convs) == 100
    for turns in convs:
        roles = [t["from"] for t in turns if t["from"] != "system"]
        assert roles and roles == ["human", "gpt"] * (len(roles) // 2)
        assert all(set(t) == {"from", "value"} and t["value"] for t in turns)

    recs = read_jsonl("preference.jsonl")
    assert len(recs) == 1000
    assert all(list(r) == ["prompt", "chosen", "rejected"] and r["prompt"] and r["chosen"] != r["rejected"]
               for r in recs)


def test_preference_responses_start_on_a_token_boundary(tok):
    """Prompt and response are tokenized apart (as generation sees them); for the demo pairs that must
    equal tokenizing them together, or the model would be taught token splits it never produces."""
    recs = read_jsonl("preference.jsonl")
    prompts, responses = [r["prompt"] for r in recs] * 2, [r["chosen"] for r in recs] + [r["rejected"] for r in recs]
    joint = tok([p + r for p, r in zip(prompts, responses)])["input_ids"]
    apart = [p + r for p, r in zip(tok(prompts)["input_ids"], tok(responses)["input_ids"])]
    assert joint == apart


@pytest.mark.slow
def test_generator_reproduces_shipped_files(tmp_path):
    # Run as a subprocess: the script pins tokenizers to one thread before importing it.
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_demo_assets.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=120)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert {p.parent.as_posix() for p in generated} == {"data/demo", "data/demo/vlm", "data/demo/vlm/images",
                                                        "assets/tokenizer", "assets/vlm"}
    assert len(generated) >= 8
    for rel in generated:
        assert (ROOT / rel).read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} differs; rerun the script"
