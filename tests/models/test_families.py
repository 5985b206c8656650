"""Every supported family (tests/helpers/families.py: Llama untied and tied, Mistral, Qwen2, Qwen3, Gemma2, Gemma3 text,
Phi3) loads as from_pretrained does, trains alike under ddp/fsdp/fsdp2, exports the logits it computes, and
masks its own chat template; encoders and headless models are refused at start."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, LlamaConfig, LlamaModel, Qwen3Config

from helpers import RECIPE, REPO, TINY
from helpers.export import assert_export_matches, save_baseline
from helpers.families import FAMILIES, SHAPE, make_family
from helpers.procs import launch, losses, read_metrics, run_side_by_side
from llmtrain import metrics as metrics_lib
from llmtrain.config import ConfigError, DataConfig, ModelConfig
from llmtrain.data.formats import IGNORE, BadRecord, encode_chat
from llmtrain.models import hf as model_lib

MATRIX = REPO / "tests" / "scripts" / "family_matrix.py"
TOL = 2e-5


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: make_family(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def matrix(family_dirs) -> dict:
    """One 2-rank launch: every family x ddp/fsdp/fsdp2 (tests/scripts/family_matrix.py)."""
    root = next(iter(family_dirs.values())).parent
    res = launch([MATRIX, root, root / "matrix.json"], nproc=2, timeout=400)
    assert res.returncode == 0, res.stderr[-6000:]
    return json.loads((root / "matrix.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_as_from_pretrained_and_trains_alike_under_every_strategy(matrix, family):
    runs = matrix[family]
    for strategy, r in runs.items():
        assert r["param_diff"] == 0 and r["buffer_diff"] == 0, (strategy, r)  # every parameter and buffer
        assert r["first_logits_diff"] < 1e-5, (strategy, r)  # on a packed batch, against from_pretrained's
        assert r["export_logits_diff"] < 1e-5, (strategy, r)  # the export computes what was trained
        assert r["losses"][-1] < r["losses"][0], (strategy, r)
    # The export's generation config stops at the family's end of turn too; plain `generate` honours it.
    assert runs["ddp"]["end_of_turn"] and set(runs["ddp"]["end_of_turn"]) <= set(runs["ddp"]["stop_ids"])
    assert runs["ddp"]["new_tokens_until_turn_end"] == 1
    assert runs["fsdp"]["losses"] == pytest.approx(runs["ddp"]["losses"], abs=TOL)
    assert runs["fsdp2"]["losses"] == pytest.approx(runs["ddp"]["losses"], abs=TOL)
    block = family.split("_")[0].title()  # llama_tied -> Llama, qwen3 -> Qwen3
    assert runs["fsdp2"]["describe"] == f"fsdp2: 2 x {block}DecoderLayer + root"
    assert runs["ddp"]["describe"] == f"ddp: whole model (2 x {block}DecoderLayer)"


@pytest.mark.slow
def test_buffers_left_on_meta_are_refused_naming_them(matrix):
    """What happened to Gemma's embed_scale before: a buffer no load fills is found, not trained on."""
    msg = matrix["meta_buffers_refused"]
    assert msg.startswith("NaN in model.embed_tokens.embed_scale, model.rotary_emb."), msg


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
                {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4+4?"},
                {"role": "assistant", "content": "Eight, that is 8."}]
END_OF_TURN = {"llama": "<|eot_id|>", "llama_tied": "<|eot_id|>", "mistral": "<|end_of_text|>", "qwen2": "<|im_end|>",
               "qwen3": "<|im_end|>", "gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>", "phi3": "<|end|>"}
REFUSE_SYSTEM = {"gemma2": "System role not supported", "mistral": "Conversation roles must alternate"}


def trained_spans(tok, ids, labels) -> list[str]:
    spans, current = [], []
    for t, label in zip(ids + [None], labels + [IGNORE]):
        if label != IGNORE:
            current.append(t)
        elif current:
            spans.append(tok.decode(current))
            current = []
    return spans


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_trains_assistant_turns_and_their_end_of_turn_only(family_dirs, family):
    tok = AutoTokenizer.from_pretrained(family_dirs[family])  # as a run loads it (Qwen2: the family's class)
    without_system = {"messages": CONVERSATION[1:]}
    ids, labels = encode_chat(without_system, DataConfig(), tok)
    eot = END_OF_TURN[family]
    assert trained_spans(tok, ids, labels) == [f"5{eot}", f"Eight, that is 8.{eot}"]
    with_system = {"messages": CONVERSATION}
    if family in REFUSE_SYSTEM:  # the family's own template refuses it: a bad record, skipped and counted
        with pytest.raises(BadRecord, match=REFUSE_SYSTEM[family]):
            encode_chat(with_system, DataConfig(), tok)
        return
    ids, labels = encode_chat(with_system, DataConfig(), tok)
    assert trained_spans(tok, ids, labels) == [f"5{eot}", f"Eight, that is 8.{eot}"]
    rendered = tok.decode(ids)
    if family == "gemma3":  # no system role: the published template merges it into the first user turn
        assert "<start_of_turn>user\nBe brief.\n\nWhat is 2+3?<end_of_turn>" in rendered
    else:
        assert "Be brief." in rendered
    if family == "qwen3":  # the template's empty reasoning block before the last answer: there, not trained
        assert "<|im_start|>assistant\n<think>\n\n</think>\n\nEight, that is 8.<|im_end|>" in rendered


def test_flops_count_attention_width_and_tied_embeddings_once():
    """flops/token = 6 N + 12 L d_attn S, N without a lookup-only input embedding (PaLM, appendix B); N as the
    recipe counts it (the meta model's parameters: a tied matrix once)."""
    vocab, seq = 512, 64

    def flops(config) -> tuple[float, int]:
        n = sum(p.numel() for p in model_lib.build_meta_model(config, ModelConfig()).parameters())
        return metrics_lib.model_flops_per_token(config, n, seq), n

    # hidden 64, 4 heads (2 kv), mlp 128, 2 layers. A layer: q, o 64x(4 x head_dim); k, v 64x(2 x head_dim);
    # gate, up, down 64x128; 2 norms of 64 (Qwen3: + q/k norms of head_dim).
    llama_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    tied, n_tied = flops(LlamaConfig(**SHAPE, vocab_size=vocab, tie_word_embeddings=True))
    untied, n_untied = flops(LlamaConfig(**SHAPE, vocab_size=vocab, tie_word_embeddings=False))
    assert n_tied == vocab * 64 + 2 * llama_layer + 64 == 106_816 and n_untied == n_tied + vocab * 64
    # the head's matmul counted once either way; the untied input embedding is a lookup
    assert tied == untied == 6 * 106_816 + 12 * 2 * 64 * seq == 739_200

    qwen3_layer = 2 * 64 * 128 + 2 * 64 * 64 + 3 * 64 * 128 + 2 * 64 + 2 * 32
    qwen3, n_qwen3 = flops(Qwen3Config(**SHAPE, vocab_size=vocab, head_dim=32, tie_word_embeddings=True))
    assert n_qwen3 == vocab * 64 + 2 * qwen3_layer + 64 == 131_520
    assert qwen3 == 6 * 131_520 + 12 * 2 * 128 * seq == 985_728  # d_attn = 4 heads x 32 = 128, not hidden 64


def test_encoders_and_headless_models_are_refused_at_start(tmp_path, run_setup):
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=512)
    BertForMaskedLM(BertConfig(**small)).save_pretrained(tmp_path / "bert")
    LlamaModel(LlamaConfig(**small)).save_pretrained(tmp_path / "llama_base")
    for name, arch in (("bert", "BertForMaskedLM"), ("llama_base", "LlamaModel")):
        with pytest.raises(ConfigError, match=rf"model.path: {tmp_path / name} is a {arch} \(config.json\), not a "
                                              "decoder-only causal LM"):
            model_lib.check_paths(ModelConfig(path=str(tmp_path / name)), None)
    # the recipe: one line, exit 2, from setup() (no process group, no model built)
    code, _, err = run_setup(RECIPE, "--config", TINY, "model.config=null", f"model.path={tmp_path / 'bert'}",
                             f"output_dir={tmp_path / 'out'}")
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [f"error: model.path: {tmp_path / 'bert'} is a BertForMaskedLM "
                                               "(config.json), not a decoder-only causal LM (a ...ForCausalLM); "
                                               "llmtrain fine-tunes causal LMs only"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gemma2_recipe_picks_eager_and_trains_alike_on_one_and_two_ranks(tmp_path, family_dirs):
    """The recipe end to end on a family that needed both fixes (embed_scale, no sdpa), on chat data whose
    system messages Gemma2's template refuses: 1 process vs fsdp2 on 2, then their exports."""
    common = [f"model.path={family_dirs['gemma2']}", "model.config=null", "tokenizer.path=null",
              f"data.path={REPO / 'data' / 'demo' / 'chat.jsonl'}", "data.format=chat"]
    runs = {"one": (tmp_path / "one", 1, [*common, "parallel.strategy=none"], RECIPE),
            "two": (tmp_path / "two", 2, [*common, "parallel.strategy=fsdp2", "train.micro_batch_size=2"], RECIPE)}
    results = run_side_by_side(runs, at_once=2)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == 4 and one[-1] < one[0], one
    assert two == pytest.approx(one, abs=TOL)
    log = results["two"].stdout
    assert "fsdp2: 2 x Gemma2DecoderLayer + root | attention eager: Gemma2ForCausalLM does not support " \
           "model.attn_implementation=sdpa" in log, log[-3000:]
    # Gemma2's template has no system role: those conversations are bad records, skipped and counted
    assert "the chat template refuses this conversation: System role not supported" in log, log[-3000:]
    assert read_metrics(tmp_path / "two")[0]["trained_tokens"] > 0
    assert_export_matches(tmp_path / "two", save_baseline(tmp_path / "one"))  # 2 ranks' export: 1 process's logits
