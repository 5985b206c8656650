"""Hostile inputs: each data, model and checkpoint file a user may bring either works or stops with one line
naming the file (and line) and what to do. Mostly the cheap single-process paths; a few through the recipe
for the exit code and the message."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer, GPT2Config, LlamaConfig, LlamaForCausalLM

from helpers import REPO, TINY
from helpers.procs import finish, run_recipe, start
from llmtrain.config import ConfigError, DataConfig, ModelConfig
from llmtrain.data import MapSteps, StreamingRows, build, check
from llmtrain.models import hf as model_lib

TOKENIZER = REPO / "assets" / "tokenizer"
GOOD = "".join(json.dumps({"text": f"the red ball number {i}"}) + "\n" for i in range(100))


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def write(path: Path, data: bytes | str) -> str:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


@pytest.mark.parametrize("content,message", [
    ("", "is empty; remove it"),
    ("\n\n  \n", r"is empty \(only blank lines\)"),
])
def test_empty_files_are_named_at_setup(tmp_path, content, message):
    path = write(tmp_path / "train.jsonl", content)
    with pytest.raises(ConfigError, match=rf"data.path: {path} {message}"):
        check(DataConfig(path=path))


@pytest.mark.parametrize("bad_line,reason", [
    (b'{"text": "a broken line\n', "malformed JSON"),
    (b'{"text": "caf\xe9 latin-1"}\n', r"not UTF-8 \(byte 0xe9 at column 14\)"),
    (b"[1, 2]\n", "not a JSON object"),
    (b'{"text": "a \\ud800 b"}\n', r"field 'text' holds a lone surrogate escape \(\\ud800\): not valid Unicode"),
    (b'{"text": "x", "meta": {"tags": ["ok", "\\udfff"]}}\n', r"field 'meta.tags\[1\]' holds a lone surrogate"),
])
def test_a_bad_line_is_skipped_or_stops_naming_its_line(tmp_path, tok, bad_line, reason):
    """Line 101 is the bad one (1-based, blank lines counted): skipped and counted with its file:line, or
    under data.strict the run stops there."""
    path = write(tmp_path / "data.jsonl", GOOD.encode() + bad_line + b"\n" + GOOD.encode())
    built = build(DataConfig(path=path, seq_len=16), tok, seed=0)
    assert built.stats.num_examples == 200 and built.stats.skipped == 1
    assert f"the first at {path}, line 101: " in built.stats.summary()
    with pytest.raises(ConfigError, match=rf"^{path}, line 101: {reason}"):
        build(DataConfig(path=path, seq_len=16, strict=True), tok, seed=0)


def test_streaming_names_a_bad_line_too(tmp_path, tok):
    path = write(tmp_path / "data.jsonl", GOOD + '{"text": oops\n' + GOOD)
    rows = list(StreamingRows(DataConfig(path=path, seq_len=16, streaming=True), tok, 0, 0, 1).rows(0))
    assert len(rows) > 0
    with pytest.raises(ConfigError, match=rf"^{path}, line 101: malformed JSON"):
        list(StreamingRows(DataConfig(path=path, seq_len=16, streaming=True, strict=True), tok, 0, 0, 1).rows(0))


def test_a_lone_surrogate_is_a_bad_record_when_streaming_and_in_python_m_llmtrain_data(tmp_path, tok, capsys):
    """A JSON escape of half a surrogate pair decodes to a str no tokenizer takes: named like any bad record,
    streamed or inspected, never a TypeError (a valid pair is kept)."""
    from llmtrain.data.__main__ import main

    path = write(tmp_path / "data.jsonl", GOOD + '{"text": "a \\ud800 b"}\n' + '{"text": "\\ud83d\\ude00"}\n' + GOOD)
    rows = list(StreamingRows(DataConfig(path=path, seq_len=16, streaming=True), tok, 0, 0, 1).rows(0))
    assert len(rows) > 0
    with pytest.raises(ConfigError, match=rf"^{path}, line 101: field 'text' holds a lone surrogate escape"):
        list(StreamingRows(DataConfig(path=path, seq_len=16, streaming=True, strict=True), tok, 0, 0, 1).rows(0))
    args = ["--config", str(TINY), "--json", f"data.path={path}", "data.seq_len=16"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_examples"] == 201 and summary["skipped"] == 1
    assert main([*args, "data.strict=true"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{path}, line 101: field 'text' holds a lone surrogate escape" in err


def test_bad_record_line_counts_blank_lines(tmp_path, tok):
    """pyarrow skips blank lines; the line named is still the file's line."""
    path = write(tmp_path / "data.jsonl", GOOD + "\n\n" + json.dumps({"text": 3}) + "\n")
    with pytest.raises(ConfigError, match=rf"{path}, line 103: field 'text' is int"):
        build(DataConfig(path=path, seq_len=16, strict=True), tok, seed=0)


@pytest.mark.parametrize("fmt,path", [("text", "data/demo/val.jsonl"), ("instruction", "data/demo/instruct.jsonl")])
def test_a_seq_len_that_trains_no_token_is_named_with_the_smallest_that_does(tok, fmt, path):
    """data.seq_len=1 (or rows that hold only prompts) trains nothing: the data says why, naming the smallest
    data.seq_len that trains a token, which does (a run refuses it: the test below)."""
    def untrained(seq_len: int) -> str:
        return build(DataConfig(path=str(REPO / path), format=fmt, seq_len=seq_len), tok, seed=0).stats.untrained

    assert untrained(1).startswith("data.seq_len=1 leaves no trained token in any row: ")
    smallest = int(re.search(r"the smallest data.seq_len that trains anything on this data is (\d+)$",
                             untrained(1)).group(1))
    assert smallest == 2 if fmt == "text" else smallest > 2
    assert untrained(smallest - 1).startswith(f"data.seq_len={smallest - 1} leaves no trained token")
    assert untrained(smallest) == ""
    rows = build(DataConfig(path=str(REPO / path), format=fmt, seq_len=smallest), tok, seed=0).train
    assert sum(int((row["labels"][1:] != -100).sum()) for row in rows) > 0


@pytest.mark.slow
def test_a_run_that_would_train_no_token_exits_2_exporting_nothing(tmp_path):
    res = run_recipe(tmp_path, "data.seq_len=1", check=False)
    assert res.returncode == 2, res.stderr[-2000:]
    assert ("error: data.seq_len=1 leaves no trained token in any row: a row's first token is never predicted"
            in res.stderr) and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "the smallest data.seq_len that trains anything on this data is 2" in res.stderr
    metrics = tmp_path / "metrics.jsonl"
    assert not (tmp_path / "hf").exists() and '"loss"' not in (metrics.read_text() if metrics.exists() else "")


def test_save_to_disk_directory_is_loaded(tmp_path, tok):
    from datasets import Dataset, DatasetDict

    records = [{"text": f"the red ball number {i}"} for i in range(30)]
    Dataset.from_list(records).save_to_disk(tmp_path / "ds")
    DatasetDict({"train": Dataset.from_list(records[:20]), "test": Dataset.from_list(records[20:])}).save_to_disk(
        tmp_path / "dd")
    for name, n in (("ds", 30), ("dd", 20)):
        section = DataConfig(path=str(tmp_path / name), seq_len=16)
        check(section)
        assert build(section, tok, seed=0).stats.num_examples == n


def test_hub_dataset_id_offline_says_how_to_pass_local_files(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"data.path: 'org/name' .* the Hub is offline .* pass local files"):
        check(DataConfig(path="org/name"))
    # No network and no offline flag: the Hub does not answer.
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"data.path: 'org/name' .* the Hub is unreachable .* pass local files"):
        check(DataConfig(path="org/name"))
    assert time.monotonic() - t0 < 30


def test_seq_len_beyond_the_models_positions_is_refused():
    with pytest.raises(ConfigError, match="data.seq_len=128 is longer than the model's max_position_embeddings=64"):
        model_lib.check_seq_len(LlamaConfig(max_position_embeddings=64), 128)
    with pytest.raises(ConfigError, match="max_position_embeddings=32"):
        model_lib.check_seq_len(GPT2Config(n_positions=32), 33)
    model_lib.check_seq_len(LlamaConfig(max_position_embeddings=64), 64)


def test_global_batch_larger_than_the_data_is_refused():
    with pytest.raises(ConfigError, match=r"gives 2 rows .* global batch of 128 \(train.micro_batch_size 64 x "
                                          r"train.grad_accum_steps 1 x 2 ranks\)"):
        MapSteps(list(range(2)), 64, 1, 2, 0, 0, 0)


@pytest.fixture(scope="module")
def truncated_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("truncated")
    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(out)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    return out


def test_truncated_safetensors_is_named(truncated_model):
    with pytest.raises(ConfigError, match=rf"model.path: {truncated_model}/model.safetensors is not a readable "
                                          "safetensors file .*truncated or corrupt"):
        model_lib.check_paths(ModelConfig(path=str(truncated_model)), None)


@pytest.mark.slow
def test_recipe_stops_with_one_line(tmp_path, truncated_model):
    """Through the recipe: exit 2, one `error:` line naming the file (or the numbers), no traceback."""
    bad = write(tmp_path / "bad.jsonl", GOOD + '{"text": oops\n')
    raw = yaml.safe_load(TINY.read_text())
    raw["model"] = {"path": str(truncated_model)}
    from_model = write(tmp_path / "from_model.yaml", yaml.safe_dump(raw))
    cases = {
        "strict": ([f"data.path={bad}", "data.strict=true"], rf"(?m)^error: {bad}, line 101: malformed JSON"),
        "weights": (["--config", from_model],
                    rf"(?m)^error: model.path: {truncated_model}/model.safetensors is not a readable safetensors"),
        "seq_len": (["data.seq_len=128"], r"(?m)^error: data.seq_len=128 is longer than the model's "
                                          "max_position_embeddings=64"),
        "batch": (["train.micro_batch_size=1000"],
                  r"(?m)^error: the training data gives \d+ rows .* fewer than one step's global batch of 1000"),
    }
    procs = {name: start([REPO / "recipes" / "finetune.py", "--config", TINY, f"output_dir={tmp_path / name}",
                          *overrides]) for name, (overrides, _) in cases.items()}
    for name, proc in procs.items():
        res = finish(proc, timeout=120)
        assert res.returncode == 2, (name, res.stderr[-3000:])
        assert "Traceback" not in res.stderr, (name, res.stderr[-3000:])
        assert len(re.findall(cases[name][1], res.stderr)) == 1, (name, res.stderr[-3000:])


def test_a_torn_metrics_line_is_read_past_and_cut_before_appending(tmp_path):
    """A run killed while writing metrics.jsonl leaves half a record: plot reads past it, and the resumed run
    cuts it before appending, so every line is a record again."""
    from llmtrain import plot
    from llmtrain.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert [r["step"] for r in plot.read_records(path)] == [1]
    logger = MetricsLogger(str(tmp_path), True, 10, 1, False, append=True)
    logger.log({"step": 2, "loss": 1.5})
    logger.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 1, "loss": 2.0},
                                                                            {"step": 2, "loss": 1.5}]
