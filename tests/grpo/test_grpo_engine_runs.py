"""recipes/grpo.py with rollout.engine=transformers end to end (tests/grpo/test_grpo_recipe.py's tiny Llama, prompts and
length reward): one process (LoRA: the engine samples the merged weights) and 2 ranks under ddp and fsdp2 train
with finite rewards and losses and log the drift guard with the engine's log-probs within 1e-5 nats of the
trainer's (fp32, no top-k / top-p), ddp and fsdp2 (the same rows per rank) sampling the same completions and
logging the same losses; a 2-rank fsdp2 run stopped at step 2 and resumed continues as the uninterrupted one (the
engine is seeded by the rows' keys and gets the weights again at the resume); and an engine that skips the weight
copy after its first push stops the run at the next push with one line naming the step, the engine, the rank and
the parameter (exit 1, no checkpoint of that step, no export)."""

from __future__ import annotations

import math

import pytest

from helpers.procs import finish_recipe, read_metrics, run_recipe, start_recipe
from helpers.grpo import GRPO, write_config

ENGINE = ("rollout.engine=transformers", "train.max_steps=4")
TWO = ("train.micro_batch_size=3",)
# An entry point running the recipe with a transformers engine that keeps its first weights (a real subclass).
STALE = """\
import runpy, sys
sys.path.insert(0, REPO)
from llmtrain.rollout import registry, transformers

class Stale(transformers.TransformersEngine):
    def update_weights(self, step, full):
        if step == 0:
            super().update_weights(step, full)

registry.ENGINES["transformers"] = Stale
runpy.run_path(REPO + "/recipes/grpo.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo_engines")
    config = write_config(tmp)
    (tmp / "stale.py").write_text(STALE.replace("REPO", repr(str(GRPO.parents[1]))))
    specs = {
        "one": (1, (*ENGINE, "lora.enabled=true", "lora.r=4", "lora.dropout=0"), GRPO),  # merged into the engine
        "ddp": (2, (*ENGINE, "parallel.strategy=ddp", *TWO), GRPO),
        "fsdp2": (2, (*ENGINE, "parallel.strategy=fsdp2", *TWO), GRPO),
        "cut": (2, (*ENGINE, "parallel.strategy=fsdp2", *TWO, "train.max_steps=2", "checkpoint.every_steps=2"), GRPO),
        "stale": (2, ("rollout.engine=transformers", "parallel.strategy=ddp", *TWO, "grpo.num_iterations=1",
                      "grpo.beta=0.0", "checkpoint.every_steps=1", "train.max_steps=3"), tmp / "stale.py"),
    }
    running, results = [], {}
    for key, (nproc, overrides, script) in specs.items():  # two at a time: a tiny run is mostly start-up
        if len(running) == 2:
            done, proc = running.pop(0)
            results[done] = finish_recipe(proc, check=done != "stale")
        running.append((key, start_recipe(tmp / key, *overrides, nproc=nproc, config=config, script=script)))
    for key, proc in running:
        results[key] = finish_recipe(proc, check=key != "stale")
    run_recipe(tmp / "cut", *ENGINE, "parallel.strategy=fsdp2", *TWO, config=config, script=GRPO, nproc=2)
    return tmp, results


def steps(out) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out) if "loss" in r}


@pytest.mark.slow
def test_transformers_engine_trains_with_its_logprobs_matching_the_trainers(runs):
    tmp, _ = runs
    for run in ("one", "ddp", "fsdp2"):
        logged = steps(tmp / run)
        assert sorted(logged) == [1, 2, 3, 4], run
        for r in logged.values():
            assert all(math.isfinite(r[k]) for k in ("loss", "reward", "grad_norm", "kl")), (run, r)
            assert r["trained_tokens"] > 0 and r["generated_tokens_per_s"] > 0
            assert 0 <= r["sampling/logprob_diff/mean"] <= r["sampling/logprob_diff/max"] < 1e-5, (run, r["step"])
            for k in ("min", "mean", "max"):
                assert r[f"sampling/importance_ratio/{k}"] == pytest.approx(1, abs=1e-5), (run, r["step"], k)
    # Each rank's rows and their keys are the same under ddp and fsdp2: the same completions and losses.
    ddp, fsdp2 = steps(tmp / "ddp"), steps(tmp / "fsdp2")
    for step in ddp:
        for k in ("loss", "reward", "completions/mean_length"):
            assert ddp[step][k] == pytest.approx(fsdp2[step][k], abs=1e-5), (step, k)


@pytest.mark.slow
def test_transformers_engine_run_resumes_exactly(runs):
    tmp, _ = runs
    whole, resumed = steps(tmp / "fsdp2"), steps(tmp / "cut")
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        for k in ("loss", "reward", "completions/mean_length", "kl", "grad_norm"):
            assert resumed[step][k] == pytest.approx(whole[step][k], abs=1e-5), (step, k)


@pytest.mark.slow
def test_a_stale_engine_stops_the_step_with_one_line(runs):
    tmp, results = runs
    res, out = results["stale"], tmp / "stale"
    assert res.returncode == 1, res.stderr[-3000:]
    # Every rank raises the same line (they agreed on it): "error (rank r): <line> (traceback in <its log>)".
    errors = {line.split(": ", 1)[1].rsplit(" (traceback in ", 1)[0] for line in res.stderr.splitlines()
              if line.startswith("error")}
    (line,) = errors
    assert line.startswith("rollout.engine=transformers: after the weight push for step 2, rank 0's engine differs "
                           "from the trainer on "), res.stderr[-3000:]
    assert line.endswith(": it would sample from stale weights"), line
    assert sorted(steps(out)) == [1] and 'grpo.py", line' not in res.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    assert not (out / "hf").exists()
