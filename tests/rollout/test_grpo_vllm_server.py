"""rollout.engine=vllm with rollout.vllm_server_url (llmtrain.rollout.vllm_server.VLLMServerEngine) against a fake vLLM
server over real HTTP (tests/helpers/vllm.py's FakeServer; vLLM needs a GPU and is not installed here), its weights
sent over a real gloo group in place of NCCL (GlooTransport): the completion requests of keyed rows (one per row,
its key's seed, token-id prompt, the sampled token's log-prob) and the Completions read back (cut at the first EOS,
truncation, log-probs); joining the weight group (rank 0 of it, the workers after); a push in vLLM's order of
routes with the tensors announced by name, dtype and shape and received in that order into a model laid out as
vLLM's, every Hugging Face tensor then equal to the trainer's in the server's dtype; the fingerprint through
llmtrain.rollout.vllm_worker.WeightCheck (the worker extension) equal to sync.trainer_fingerprint's, and a worker
that did not load the push (a stale one among two) stopping the step; one-line errors for no server, a server
without the worker extension or the weight transfer engine, and a failing route; the set-up checks of
rollout.vllm_server_url; and recipes/grpo.py end to end on 2 ranks (ddp) against a fake server that samples from the
weights pushed to it (fp32): the drift guard's log-probs within 1e-5 nats of the trainer's on every step, one push
and one fingerprint request per generation batch, one request per completion, and a server whose worker missed the
push stopping the run at once with one line (the recipe's own entry point, its NCCL transport swapped for gloo and
its CPU refusal lifted by a wrapper script)."""

from __future__ import annotations

import math
import socket

import pytest
import torch

from helpers import REPO
from helpers.engines import stale_copy_is_caught
from helpers.grpo import write_config
from helpers.procs import finish_recipe, read_metrics, start_recipe
from helpers.vllm import PACKED, FakeServer, GlooTransport, sampled, trainer
from llmtrain.config import ConfigError, RunError, load_config
from llmtrain.export import hf_state
from llmtrain.models.hf import load_model_config, load_tokenizer
from llmtrain.parallelize import STRATEGIES
from llmtrain.recipes import RECIPES
from llmtrain.rollout import registry, section as rollout_section, sync
from llmtrain.rollout.engine import EngineSetup
from llmtrain.rollout.section import RolloutSection
from llmtrain.rollout.local import Sampling, sample_seed
from llmtrain.rollout.vllm import hf_view
from llmtrain.rollout.vllm_server import VLLMServerEngine

EOS, PAD = [2, 3], 0
CPU = torch.device("cpu")
ROWS = [p for p in ([1, 4, 6], [1, 5], [1, 7, 9, 11]) for _ in range(2)]
KEYS = [(5, 0, i // 2, i % 2) for i in range(len(ROWS))]
SAMPLING = Sampling(max_tokens=10, temperature=0.8, top_p=0.9, top_k=0)
SEED = 7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def model():
    return trainer()


@pytest.fixture
def server(model):
    servers = []

    def start(**kwargs) -> FakeServer:
        servers.append(FakeServer(model.config, **kwargs))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def engine(url: str, model, timeout: float = 30.0, port: int | None = None) -> VLLMServerEngine:
    setup = EngineSetup(model, model.config, None, EOS, PAD, CPU, 48, len(ROWS), SEED, torch.float32, "unused")
    section = RolloutSection(engine="vllm", vllm_server_url=url, vllm_server_timeout=timeout,
                             vllm_group_port=port or free_port())
    return VLLMServerEngine(section, setup, transport=GlooTransport)


def test_keyed_rows_become_one_request_each_and_completions_are_read_back(server, model, single_process_group):
    fake = server()
    e = engine(fake.url, model)
    out = e.generate(ROWS, KEYS, SAMPLING)
    bodies = [body for route, body in fake.calls if route == "/v1/completions"]
    assert sorted(bodies, key=lambda b: b["seed"]) == sorted(
        [{"model": "policy", "prompt": row, "return_token_ids": True, "n": 1, "temperature": 0.8, "top_p": 0.9,
          "top_k": -1, "max_tokens": 10, "logprobs": 0, "stop_token_ids": EOS, "seed": sample_seed(*key)}
         for row, key in zip(ROWS, KEYS)], key=lambda b: b["seed"])
    cut = 0
    for tokens, truncated, logps, key in zip(out.tokens, out.truncated, out.logps, KEYS):
        ids, _ = sampled(sample_seed(*key), SAMPLING.max_tokens, EOS)  # what the server answered for this row
        first = next((i + 1 for i, t in enumerate(ids) if t in EOS), None)
        assert tokens == ids[:first] and truncated == (first is None)
        assert logps == [-0.5 * (i + 1) for i in range(len(tokens))]
        cut += len(ids) - len(tokens)
    assert cut > 0 and any(out.truncated) and not all(out.truncated)  # tokens past an EOS were dropped
    assert out.seconds >= 0


def test_push_over_the_group_and_the_workers_fingerprints(server, model, single_process_group):
    fake = server(workers=2)
    port = free_port()
    e = engine(fake.url, model, port=port)
    (init,) = [body["init_info"] for route, body in fake.calls if route == "/init_weight_transfer_engine"]
    assert init == {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3}
    assert e.weights_dtype == torch.bfloat16 and e.copies_weights  # the workers' dtype, through the extension
    full = hf_state(model, STRATEGIES["none"], CPU)
    del fake.calls[:]
    e.update_weights(0, full)
    routes = [route for route, _ in fake.calls]
    assert routes == ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    info = fake.calls[1][1]["update_info"]
    assert info["names"] == e.pushed and set(e.pushed) | {"lm_head.weight"} == set(full)  # the tied weight once
    assert info["dtype_names"] == ["bfloat16"] * len(e.pushed)
    assert info["shapes"] == [list(full[n].shape) for n in e.pushed]
    for worker in fake.workers:
        params = dict(worker.model_runner.model.named_parameters(remove_duplicate=False))
        for name, tensor in full.items():  # each Hugging Face tensor read back from vLLM's layout, exactly
            assert torch.equal(hf_view(params, PACKED, e.shapes, name), tensor.to(torch.bfloat16)), name
    expected = sync.trainer_fingerprint(full, SEED, 0, e.weights_dtype)
    assert e.fingerprint(list(expected)) == expected == sync.fingerprint(full, list(expected), torch.bfloat16)
    sync.check(expected, e.fingerprint(list(expected)), 0, "vllm")
    stale_copy_is_caught(model, e, "vllm", 1e-2, SEED)  # the trainer moved without a push; then pushed: equal


def test_a_worker_that_missed_the_push_stops_the_step(server, model, single_process_group):
    fake = server(workers=2, stale=(1,))
    e = engine(fake.url, model)
    full = hf_state(model, STRATEGIES["none"], CPU)
    e.update_weights(0, full)
    expected = sync.trainer_fingerprint(full, SEED, 0, e.weights_dtype)
    with pytest.raises(RunError, match=r"^rollout.engine=vllm: after the weight push for step 1, rank 0's engine "
                                       r"differs from the trainer on .*: it would sample from stale weights$"):
        sync.check(expected, e.fingerprint(list(expected)), 0, "vllm")


def one_line(error: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(error.value)
    return str(error.value)


def test_no_server_is_one_line_after_the_timeout(model, single_process_group):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RunError) as e:
        engine(url, model, timeout=1.5)
    assert one_line(e).startswith(f"rollout.vllm_server_url: no vLLM server answered at {url} within "
                                  "rollout.vllm_server_timeout=1.5 s (")


@pytest.mark.parametrize("kwargs, message", [
    ({"extension": False}, "rollout.vllm_server_url: /collective_rpc at {url} answered 500: "
                           "{{\"error\": \"AttributeError: 'Worker' object has no attribute 'llmtrain_dtype'\"}}; the "
                           "weight-sync check needs the server started with VLLM_SERVER_DEV_MODE=1 and "
                           "--worker-extension-cls llmtrain.rollout.vllm_worker.WeightCheck (docs/grpo.md)"),
    ({"weight_transfer": False}, "rollout.vllm_server_url: the server at {url} has no weight transfer engine; start it "
                                 "with --weight-transfer-config '{{\"backend\": \"nccl\"}}' (docs/grpo.md)"),
    ({"failing": "/v1/models"}, "rollout.vllm_server_url: /v1/models at {url} answered 500: {{\"error\": \"boom\"}}"),
])
def test_a_server_that_cannot_serve_the_run_is_one_line(server, model, single_process_group, kwargs, message):
    fake = server(**kwargs)
    with pytest.raises(RunError) as e:
        engine(fake.url, model)
    assert one_line(e) == message.format(url=fake.url)


def test_a_failing_completion_is_one_line(server, model, single_process_group):
    fake = server(failing="/v1/completions")
    e = engine(fake.url, model)
    with pytest.raises(RunError) as error:
        e.generate(ROWS, KEYS, SAMPLING)
    assert one_line(error) == (f"rollout.vllm_server_url: /v1/completions at {fake.url} answered 500: "
                               '{"error": "boom"}')


@pytest.mark.parametrize("engine_name, url, message", [
    ("local", "http://host:8000", "rollout.vllm_server_url: a server generates for rollout.engine=vllm only, and "
                                  "rollout.engine is local; set rollout.engine=vllm, or leave rollout.vllm_server_url "
                                  "unset"),
    ("vllm", "host:8000", "rollout.vllm_server_url: 'host:8000' is not a server's base URL like http://host:8000"),
    ("vllm", "http://host:8000/v1", "rollout.vllm_server_url: 'http://host:8000/v1' is not a server's base URL"),
    ("vllm", "http://host:8000", "rollout.engine: vllm runs on CUDA GPUs only and this run is on CPU"),
])
def test_the_recipe_checks_the_server_url_at_set_up(monkeypatch, tmp_path, engine_name, url, message):
    """recipes/grpo.py's set-up (before any process group) with rollout.vllm_server_url, and its keys' ranges."""
    monkeypatch.chdir(REPO)
    cls = RECIPES["grpo"].config_cls
    (tmp_path / "grpo.yaml").write_text(
        "model: {config: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 4}}\n"
        "tokenizer: {path: assets/tokenizer}\n"
        "data: {path: data/demo/prompts.jsonl, format: prompt, seq_len: 32}\n"
        "train: {micro_batch_size: 8}\n"
        "grpo: {reward_funcs: [llmtrain.rewards:format_regex]}\n"
        f"rollout: {{engine: {engine_name}, vllm_server_url: '{url}'}}\n")
    cfg = load_config(tmp_path / "grpo.yaml", ["distributed.device=cpu"], cls=cls)
    with pytest.raises(ConfigError) as e:
        RECIPES["grpo"]().check(cfg)
    assert one_line(e).startswith(message)
    for key, bad in (("vllm_server_timeout", "0"), ("vllm_group_port", "70000")):
        with pytest.raises(ConfigError, match=f"rollout.{key}") as e:
            load_config(tmp_path / "grpo.yaml", [f"rollout.{key}={bad}"], cls=cls)
        one_line(e)


def test_a_well_formed_url_on_cuda_with_vllm_is_taken(monkeypatch):
    """Each URL passes the URL check: on CUDA (vllm found) check_engine raises nothing, and on CPU the one refusal
    left is the device's, not the URL's."""
    monkeypatch.setattr(rollout_section, "find_spec", lambda name: object())
    for url in ("http://host:8000", "https://10.0.0.7:8000/", "http://gpu-node"):
        section = RolloutSection(engine="vllm", vllm_server_url=url)
        assert rollout_section.check_engine(section, True) is None
        with pytest.raises(ConfigError) as e:
            rollout_section.check_engine(section, False)
        assert one_line(e).startswith("rollout.engine: vllm runs on CUDA GPUs only"), url


def test_the_server_url_picks_the_server_engine(monkeypatch):
    """ENGINES["vllm"] (what llmtrain.rollout.registry.build makes) is the server engine when the rollout: section
    names a server."""
    built = []
    for name in ("VLLMServerEngine", "VLLMEngine"):
        monkeypatch.setattr(registry, name,
                            lambda section, setup, name=name: built.append((name, section.vllm_server_url)))
    setup = EngineSetup(None, None, None, EOS, PAD, CPU, 48, 6, SEED, torch.bfloat16, "unused")
    for url in ("http://host:8000", None):
        registry.ENGINES["vllm"](RolloutSection(engine="vllm", vllm_server_url=url), setup)
    assert built == [("VLLMServerEngine", "http://host:8000"), ("VLLMEngine", None)]


# recipes/grpo.py as users run it, but with the server engine's weights over gloo (no NCCL on a CPU) and the
# set-up's CUDA / vllm-package refusal lifted (the server is a fake; nothing of vllm is imported).
ON_CPU = """\
import functools, runpy, sys
sys.path[:0] = [REPO, REPO + "/tests"]
from helpers.vllm import GlooTransport
from llmtrain.recipes.grpo import recipe
from llmtrain.rollout import registry, section, vllm_server

section.find_spec = lambda name: object()
recipe.check_engine = lambda rollout, cuda: section.check_engine(rollout, True)
registry.VLLMServerEngine = functools.partial(vllm_server.VLLMServerEngine, transport=GlooTransport)
runpy.run_path(REPO + "/recipes/grpo.py", run_name="__main__")
"""
STEPS = 4  # helpers.grpo's num_iterations 2: two generation batches, two pushes


@pytest.fixture(scope="module")
def server_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo_vllm_server")
    config = write_config(tmp)
    (tmp / "on_cpu.py").write_text(ON_CPU.replace("REPO", repr(str(REPO))))
    section = load_config(config, [], cls=RECIPES["grpo"].config_cls).model
    hf_config = load_model_config(section, load_tokenizer(str(REPO / "assets" / "tokenizer"), False))
    servers = {"run": FakeServer(hf_config, dtype=torch.float32, policy=True),
               "stale": FakeServer(hf_config, dtype=torch.float32, stale=(0,))}
    procs = {key: start_recipe(tmp / key, "rollout.engine=vllm", f"rollout.vllm_server_url={s.url}",
                               f"rollout.vllm_group_port={free_port()}", "parallel.strategy=ddp",
                               "train.micro_batch_size=3", f"train.max_steps={STEPS}", nproc=2, config=config,
                               script=tmp / "on_cpu.py")
             for key, s in servers.items()}
    try:
        yield tmp, servers, {key: finish_recipe(proc, check=key == "run") for key, proc in procs.items()}
    finally:
        for s in servers.values():
            s.close()


@pytest.mark.slow
def test_the_recipe_trains_on_a_servers_completions_with_matching_logprobs(server_runs):
    tmp, servers, _ = server_runs
    logged = {r["step"]: r for r in read_metrics(tmp / "run") if "loss" in r}
    assert sorted(logged) == list(range(1, STEPS + 1))
    for r in logged.values():
        assert all(math.isfinite(r[k]) for k in ("loss", "reward", "grad_norm", "kl")), r
        assert r["trained_tokens"] > 0 and r["generated_tokens_per_s"] > 0
        # The server's log-probs, token by token, are the trainer's recomputation on the same tokens.
        assert 0 <= r["sampling/logprob_diff/mean"] <= r["sampling/logprob_diff/max"] < 1e-5, r["step"]
    calls = servers["run"].calls
    routes = [route for route, _ in calls]
    checks = [b for route, b in calls if route == "/collective_rpc" and b["method"] == "llmtrain_fingerprint"]
    assert routes.count("/init_weight_transfer_engine") == 1 and routes.count("/update_weights") == STEPS // 2
    assert len(checks) == STEPS // 2  # rank 0 asks once per push; the other ranks get its answer
    assert routes.count("/v1/completions") == STEPS // 2 * 3 * 2 * 2  # micro-batch x accumulation x ranks each
    # The server answered both ranks' checks at once in this process (hf_layout in two threads): nothing of it
    # is left building modules on meta here.
    assert not torch.nn.Linear(2, 2).weight.is_meta
    assert (tmp / "run" / "hf" / "model.safetensors").exists()


@pytest.mark.slow
def test_a_server_worker_that_missed_the_push_stops_the_run(server_runs):
    tmp, servers, results = server_runs
    res = results["stale"]
    assert res.returncode == 1, res.stderr[-3000:]
    # Every rank raises the same line (they agreed on it): "error (rank r): <line> (traceback in <its log>)".
    (line,) = {line.split(": ", 1)[1].rsplit(" (traceback in ", 1)[0] for line in res.stderr.splitlines()
               if line.startswith("error")}
    assert line.startswith("rollout.engine=vllm: after the weight push for step 1, rank 0's engine differs from the "
                           "trainer on ") and line.endswith(": it would sample from stale weights"), line
    assert "/v1/completions" not in [route for route, _ in servers["stale"].calls]  # stopped before sampling
    assert not (tmp / "stale" / "hf").exists()
