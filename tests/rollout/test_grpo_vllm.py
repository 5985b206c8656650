"""rollout.engine=vllm (llmtrain.rollout.vllm.VLLMEngine) against a fake `vllm` module put in sys.modules (vllm is not
installed here and needs a GPU): the LLM it builds (the policy's config in a directory under output_dir, dummy
weights, no tokenizer, external_launcher, processed log-probs, the EngineSetup's sizes and dtype); the requests of
keyed rows (vllm_requests' parameters as SamplingParams, token-id prompts) and the Completions read back (tokens to
the first EOS even when more follow, truncation, the log-prob of each kept token); a push (export.hf_state of a
trainer Llama with GQA and tied embeddings) through load_weights by Hugging Face names into a model laid out as
vLLM's (q/k/v and gate/up fused, vocabulary padded to 64, lm_head tied), after which every Hugging Face tensor read
back through hf_view equals the trainer's in bf16, the fingerprint equals sync.trainer_fingerprint's and a stale
copy stops the step (sync.check) until the next push; sleep mode's order (asleep after building and after each
generate, woken before a push); and the set-up refusals of rollout.engine=vllm (on CPU; on CUDA without the package:
find_spec faked), one line each naming the key. A real vLLM on a GPU: bench/gpu/engines.py (through bench/gpu.sh)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import REPO
from helpers.engines import stale_copy_is_caught
from helpers.vllm import PACKED, PADDED, VOCAB, FakeVLLMModel, sampled, trainer
from llmtrain.config import ConfigError, RunError, load_config
from llmtrain.export import hf_state
from llmtrain.parallelize import STRATEGIES
from llmtrain.recipes.grpo import GRPO, GRPOConfig
from llmtrain.rollout import section as rollout_section, sync
from llmtrain.rollout.engine import EngineSetup
from llmtrain.rollout.section import RolloutSection
from llmtrain.rollout.local import Sampling
from llmtrain.rollout.vllm import VLLMEngine, hf_view, vllm_requests

EOS, PAD = [2, 3], 0
CPU = torch.device("cpu")
PROMPTS = [[1, 4, 6], [1, 5], [1, 7, 9, 11]]
ROWS = [p for p in PROMPTS for _ in range(2)]
KEYS = [(5, 0, i // 2, i % 2) for i in range(len(ROWS))]
SAMPLING = Sampling(max_tokens=10, temperature=0.8, top_p=0.9, top_k=0)


class FakeLLM:
    """vllm.LLM's surface that VLLMEngine uses: built from a model directory (config.json read here), generate
    (each request's tokens from its own seed; odd seeds return PAST_EOS tokens after the EOS), sleep / wake_up /
    reset_prefix_cache recorded in `events`, the model at llm_engine.model_executor.driver_worker.model_runner."""
    built: list[dict] = []

    def __init__(self, **kwargs):
        FakeLLM.built.append(kwargs)
        self.events, self.calls = [], []
        config = LlamaConfig.from_pretrained(kwargs["model"])
        self.config_json = json.loads((Path(kwargs["model"]) / "config.json").read_text())
        model = FakeVLLMModel(config, getattr(torch, kwargs["dtype"]), self.events)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model))))

    def sleep(self, level: int):
        self.events.append("sleep")
        assert level == 1

    def wake_up(self):
        self.events.append("wake_up")

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")

    def generate(self, prompts, sampling_params, use_tqdm):
        assert not self.events or self.events[-1] != "sleep", "generate on a sleeping engine"
        self.events.append("generate")
        out = []
        for p in sampling_params:
            ids, logps = sampled(p.seed, p.max_tokens, p.stop_token_ids)
            logprobs = [{t: SimpleNamespace(logprob=x, rank=1)} for t, x in zip(ids, logps)]
            out.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)]))
        self.calls.append((prompts, sampling_params, use_tqdm, out))
        return out


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.built.clear()
    return module


def engine(tmp_path, model: LlamaForCausalLM, sleep_mode: bool = False) -> VLLMEngine:
    setup = EngineSetup(model, model.config, None, EOS, PAD, CPU, 48, len(ROWS), 7, torch.bfloat16, str(tmp_path))
    return VLLMEngine(RolloutSection(vllm_gpu_memory_utilization=0.25, vllm_enable_sleep_mode=sleep_mode), setup)


def test_llm_is_built_on_the_policy_config_with_dummy_weights(fake_vllm, tmp_path, single_process_group):
    e = engine(tmp_path, trainer())
    (kwargs,) = FakeLLM.built
    assert kwargs.pop("model") == str(tmp_path / ".vllm-config" / "rank0")
    assert kwargs == {"load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16", "seed": 7,
                      "distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1,
                      "gpu_memory_utilization": 0.25, "max_model_len": 48, "max_num_seqs": 6,
                      "max_num_batched_tokens": 4096, "enable_sleep_mode": False,
                      "logprobs_mode": "processed_logprobs"}
    config = e.llm.config_json
    assert config["architectures"] == ["LlamaForCausalLM"]  # vLLM picks its model class by it
    assert (config["hidden_size"], config["num_key_value_heads"], config["vocab_size"]) == (32, 2, VOCAB)
    assert e.llm.events == [] and e.weights_dtype == torch.bfloat16 and e.copies_weights
    assert "lm_head.weight" not in e.pushed and len(e.pushed) == len(e.shapes) - 1  # the tied weight once


def test_requests_from_keyed_rows_and_completions_read_back(fake_vllm, tmp_path, single_process_group):
    e = engine(tmp_path, trainer())
    out = e.generate(ROWS, KEYS, SAMPLING)
    ((prompts, params, use_tqdm, raw),) = e.llm.calls
    expected = vllm_requests(ROWS, KEYS, SAMPLING, EOS)
    assert prompts == [p for p, _ in expected] == [{"prompt_token_ids": r} for r in ROWS] and use_tqdm is False
    assert [vars(p) for p in params] == [p for _, p in expected]
    assert all(p.detokenize is False and p.logprobs == 0 and p.stop_token_ids == EOS for p in params)
    cut = 0
    for tokens, truncated, logps, request in zip(out.tokens, out.truncated, out.logps, raw):
        ids = request.outputs[0].token_ids
        first = next((i + 1 for i, t in enumerate(ids) if t in EOS), None)
        assert tokens == ids[:first] and truncated == (first is None)
        assert len(tokens) == (first or SAMPLING.max_tokens)
        assert logps == [-0.5 * (i + 1) for i in range(len(tokens))]
        cut += len(ids) - len(tokens)
    assert cut > 0 and any(out.truncated) and not all(out.truncated)  # tokens past an EOS were dropped
    assert out.seconds >= 0


def test_push_by_hf_names_and_the_fingerprint_of_vllms_fused_copy(fake_vllm, tmp_path, single_process_group):
    model = trainer()
    e = engine(tmp_path, model)
    full = hf_state(model, STRATEGIES["none"], CPU)
    e.update_weights(0, full)
    loads = [ev for ev in e.llm.events if ev[0] == "load"]
    assert [name for _, name, _ in loads] == e.pushed and set(e.pushed) | {"lm_head.weight"} == set(full)
    assert {dtype for *_, dtype in loads} == {torch.bfloat16} and e.llm.events[-1] == "reset_prefix_cache"
    vllm_model = e.vllm_model()
    params = dict(vllm_model.named_parameters(remove_duplicate=False))
    assert params["model.layers.0.self_attn.qkv_proj.weight"].shape == (32 + 16 + 16, 32)  # q, k, v: 4, 2, 2 heads of 8
    assert params["model.embed_tokens.weight"].shape == (PADDED, 32)  # padded vocabulary
    for name, tensor in full.items():  # each Hugging Face tensor read back from vLLM's layout, exactly
        assert torch.equal(hf_view(params, PACKED, e.shapes, name), tensor.to(torch.bfloat16)), name
    assert e.fingerprint(list(full)) == sync.fingerprint(full, list(full), torch.bfloat16)
    expected = sync.trainer_fingerprint(full, 7, 0, e.weights_dtype)
    assert len(expected) == sync.PARAMETERS and expected == e.fingerprint(list(expected))
    sync.check(expected, e.fingerprint(list(expected)), 0, "vllm")
    # The fp32 fingerprint of the same weights differs: the bf16 copy is matched only in its own dtype.
    assert sync.fingerprint(full, list(expected), torch.float32) != expected

    stale_copy_is_caught(model, e, "vllm", 1e-2, 7)  # 1e-2: it moves weights of ~0.02 in bf16 too


def test_sleep_mode_sleeps_between_generations(fake_vllm, tmp_path, single_process_group):
    model = trainer()
    e = engine(tmp_path, model, sleep_mode=True)
    assert FakeLLM.built[0]["enable_sleep_mode"] is True and e.llm.events == ["sleep"]
    for step in range(2):
        e.update_weights(step, hf_state(model, STRATEGIES["none"], CPU))
        e.fingerprint(["model.norm.weight"])
        e.generate(ROWS, KEYS, SAMPLING)
    order = [ev for ev in e.llm.events if ev[0] != "load"]
    assert order == ["sleep", *["wake_up", "reset_prefix_cache", "generate", "sleep"] * 2]
    assert all(e.llm.events[i + 1][0] == "load" for i, ev in enumerate(e.llm.events) if ev == "wake_up")

    plain = engine(tmp_path, model)
    plain.update_weights(0, hf_state(model, STRATEGIES["none"], CPU))
    plain.generate(ROWS, KEYS, SAMPLING)
    assert [ev for ev in plain.llm.events if ev[0] != "load"] == ["reset_prefix_cache", "generate"]


def test_a_name_vllm_does_not_hold_is_one_line():
    params = {"model.norm.weight": torch.zeros(4)}
    with pytest.raises(RunError) as e:
        hf_view(params, PACKED, {"model.layers.0.self_attn.q_proj.weight": (4, 4)},
                "model.layers.0.self_attn.q_proj.weight")
    assert str(e.value).startswith("rollout.engine=vllm: no vLLM parameter holds "
                                   "model.layers.0.self_attn.q_proj.weight [4, 4]") and "\n" not in str(e.value)


@pytest.mark.parametrize("cuda, installed, message", [
    (False, True, "rollout.engine: vllm runs on CUDA GPUs only and this run is on CPU; use rollout.engine=local or "
                  "transformers"),
    (True, False, "rollout.engine: vllm is not installed in this environment; pip install vllm"),
])
def test_vllm_is_refused_at_set_up_in_one_line(monkeypatch, cuda, installed, message):
    monkeypatch.setattr(rollout_section, "find_spec", lambda name: object() if installed else None)
    for other in ("local", "transformers"):
        rollout_section.check_engine(RolloutSection(engine=other), cuda)
    with pytest.raises(ConfigError) as e:
        rollout_section.check_engine(RolloutSection(engine="vllm"), cuda)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_vllm_on_cuda_with_the_package_is_taken(monkeypatch):
    looked_up = []
    monkeypatch.setattr(rollout_section, "find_spec", lambda name: looked_up.append(name) or object())
    rollout_section.check_engine(RolloutSection(engine="vllm"), True)
    assert looked_up == ["vllm"]


RECIPE_CONFIG = """\
model:
  config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 2, max_position_embeddings: 64}
tokenizer: {path: assets/tokenizer}
data: {path: data/demo/prompts.jsonl, format: prompt, seq_len: 32}
train: {micro_batch_size: 8}
grpo: {reward_funcs: [llmtrain.rewards:format_regex]}
rollout: {engine: vllm}
"""


@pytest.mark.parametrize("device, message", [
    ("cpu", "rollout.engine: vllm runs on CUDA GPUs only"),
    ("cuda", "rollout.engine: vllm is not installed in this environment; pip install vllm"),
])
def test_the_recipe_refuses_vllm_at_set_up(monkeypatch, tmp_path, device, message):
    """recipes/grpo.py's set-up (GRPO.check, before any process group) with rollout.engine=vllm, and a bad
    rollout.vllm_gpu_memory_utilization at load_config."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(rollout_section, "find_spec", lambda name: None)
    (tmp_path / "grpo.yaml").write_text(RECIPE_CONFIG)
    cfg = load_config(tmp_path / "grpo.yaml", [f"distributed.device={device}"], cls=GRPOConfig)
    with pytest.raises(ConfigError) as e:
        GRPO().check(cfg)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="rollout.vllm_gpu_memory_utilization") as e:
        load_config(tmp_path / "grpo.yaml", ["rollout.vllm_gpu_memory_utilization=1.5"], cls=GRPOConfig)
    assert "\n" not in str(e.value)
