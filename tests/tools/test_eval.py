"""python -m llmtrain.eval: the harness's own numbers (equal to lm-eval's CLI), from an export, from the DCP
checkpoint it came from and from 2 data-parallel processes; bad input exits 2 with one line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from helpers import REPO
from helpers.procs import BIN, TWO_RANKS, launch, losses_by_step, read_metrics, run_recipe

pytest.importorskip("lm_eval")

from llmtrain import eval as harness

DEMO_TASKS = REPO / "assets" / "eval" / "demo"
LIMIT = "12"  # documents per task: every request type, a few seconds on the tiny model


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_run(reference_run):
    """tests/tiny.yaml (4 steps, one process) with its checkpoint at the last step and its export: the
    reference run (tests/conftest.py)."""
    out = reference_run
    assert (out / "hf" / "config.json").is_file() and (out / "checkpoints" / "step_4" / ".metadata").is_file()
    return out


@pytest.fixture(scope="module")
def export_results(tiny_run, tmp_path_factory) -> dict:
    """llmtrain.eval on the export, in a process of its own as a user runs it."""
    out = tmp_path_factory.mktemp("eval_results") / "export.json"
    res = launch(["-m", "llmtrain.eval", "--model", tiny_run / "hf", "--tasks", DEMO_TASKS, "--limit", LIMIT,
                  "--device", "cpu", "--output", out])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "demo_facts" in res.stdout and "demo_recall" in res.stdout  # the table
    return json.loads(out.read_text())


def test_demo_tasks_regenerate(tmp_path):
    """The bundled task data is what make_tasks.py writes from the demo world."""
    before = {f: (DEMO_TASKS / f).read_bytes() for f in ("facts.jsonl", "recall.jsonl")}
    res = subprocess.run([sys.executable, DEMO_TASKS / "make_tasks.py"], check=False, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert {f: (DEMO_TASKS / f).read_bytes() for f in before} == before


@pytest.mark.slow
def test_export_scores_equal_lm_eval_cli(tiny_run, export_results, tmp_path):
    """lm-eval's own CLI (it loads the directory itself) on the same export and tasks: the same numbers,
    standard errors included. (lm-eval reads relative data_files from its working directory: give it the
    bundled YAMLs with absolute ones.)"""
    tasks = []
    for name, data in (("demo_facts", "facts.jsonl"), ("demo_recall", "recall.jsonl")):
        text = (DEMO_TASKS / f"{name}.yaml").read_text().replace(f"test: {data}", f"test: {DEMO_TASKS / data}")
        tasks.append(_task_yaml(tmp_path, text, f"{name}.yaml"))
    res = launch([BIN / "lm_eval", "--model", "hf", "--model_args", f"pretrained={tiny_run / 'hf'}", "--tasks",
                  ",".join(map(str, tasks)), "--limit", LIMIT, "--device", "cpu", "--batch_size", "1",
                  "--output_path", tmp_path / "cli"], torchrun=False, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    cli = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())
    assert cli["results"] == export_results["results"]
    assert {k for m in cli["results"].values() for k in m} >= {"acc,none", "acc_norm,none", "exact_match,strip",
                                                              "acc_stderr,none"}


@pytest.mark.slow
def test_checkpoint_scores_equal_its_export(tiny_run, export_results):
    """The DCP checkpoint, converted in memory, scores exactly as the export written from the same weights."""
    scores = harness.score(tiny_run / "checkpoints" / "step_4", None, [str(DEMO_TASKS)], limit=int(LIMIT))
    assert scores == harness.flat_scores(export_results)
    assert set(scores) == {"harness/demo_facts/acc,none", "harness/demo_facts/acc_norm,none",
                           "harness/demo_recall/exact_match,strip"}


@pytest.mark.slow
def test_score_in_memory_model_leaves_rng_and_mode(tiny_run, export_results):
    """The recipes' call: an in-memory model scores as its directory does, and neither the RNG streams
    (simple_evaluate seeds them all) nor train mode move."""
    import random

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_run / "hf").train()
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    before = torch.rand(4), np.random.rand(4), random.random()
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    scores = harness.score(model, AutoTokenizer.from_pretrained(tiny_run / "hf"), [str(DEMO_TASKS)],
                           limit=int(LIMIT))
    assert scores == harness.flat_scores(export_results)
    after = torch.rand(4), np.random.rand(4), random.random()
    assert torch.equal(before[0], after[0]) and (before[1] == after[1]).all() and before[2] == after[2]
    assert model.training


@pytest.mark.slow
def test_lora_adapter_checkpoint_and_merged_export_score_the_same(tiny_run, tmp_path):
    """A LoRA run on the tiny export: its PEFT adapter on the base, its merged export and its checkpoint
    (adapters merged onto model.path in memory) give the same scores."""
    out = tmp_path / "lora"
    run_recipe(out, f"model.path={tiny_run / 'hf'}", "model.config=null", "lora.enabled=true", "lora.r=4",
               "train.lr=1.0e-2", "checkpoint.every_steps=4")
    scores = {name: harness.score(out / sub, None, [str(DEMO_TASKS)], limit=int(LIMIT))
              for name, sub in (("adapter", "adapter"), ("merged", "hf"), ("checkpoint", "checkpoints/step_4"))}
    assert scores["adapter"] == scores["merged"] == scores["checkpoint"], scores
    assert len(scores["merged"]) == 3


@pytest.mark.slow
def test_two_processes_score_as_one(tiny_run, export_results, tmp_path):
    """torchrun with 2 processes (gloo): each rank scores half the requests, the results are the same."""
    out = tmp_path / "dp2.json"
    res = launch(["-m", "llmtrain.eval", "--model", tiny_run / "hf", "--tasks", DEMO_TASKS, "--limit", LIMIT,
                  "--device", "cpu", "--output", out], nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    # Each rank generated for half the documents (the progress bars show the split).
    # (The two ranks' bars share one pipe and may cut into each other's lines: count their final counters.)
    half = int(LIMIT) // 2
    assert len(re.findall(rf"\| {half}/{half} \[", res.stderr)) >= 2
    assert json.loads(out.read_text())["results"] == export_results["results"]


@pytest.mark.slow
def test_compare_prints_files_side_by_side(export_results, tmp_path, capsys):
    a, b = tmp_path / "base.json", tmp_path / "tuned.json"
    a.write_text(json.dumps(export_results))
    tuned = json.loads(json.dumps(export_results))
    tuned["results"]["demo_facts"]["acc,none"] = 0.75
    b.write_text(json.dumps(tuned))
    assert harness.main(["--compare", str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["task", "|", "metric", "|", "filter", "|", "base", "|", "tuned"]
    acc = next(line for line in lines if "| acc " in line and "demo_facts" in line)
    err = export_results["results"]["demo_facts"]["acc_stderr,none"]
    value = export_results["results"]["demo_facts"]["acc,none"]
    assert f"{value:.4f} ± {err:.4f}" in acc and f"0.7500 ± {err:.4f}" in acc


def _task_yaml(tmp_path, text: str, name: str = "bad.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD_TASK = (DEMO_TASKS / "demo_facts.yaml").read_text()


@pytest.mark.parametrize("case", ["missing model", "missing checkpoint state", "adapter without base",
                                  "unknown task", "malformed yaml", "missing data file", "hub dataset",
                                  "missing task file"])
@pytest.mark.slow
def test_bad_input_exits_2_with_one_line(case, tiny_run, tmp_path, capsys):
    model, tasks = tiny_run / "hf", str(DEMO_TASKS)
    if case == "missing model":
        model, named = tmp_path / "nope", "nope: no such directory"
    elif case == "missing checkpoint state":
        model = tmp_path / "step_9"
        model.mkdir()
        (model / ".metadata").write_bytes(b"")
        named = "step_9 is not a complete llmtrain checkpoint"
    elif case == "adapter without base":
        model = tmp_path / "adapter"
        model.mkdir()
        (model / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "gone/base"}))
        named = "gone/base is not a model directory here; pass --base"
    elif case == "unknown task":
        tasks, named = "no_such_task_xyz", "unknown task no_such_task_xyz"
    elif case == "malformed yaml":
        tasks, named = str(_task_yaml(tmp_path, "task: broken\ndoc_to_text: [context\nmetric_list: 1\n")), \
            "bad.yaml:3: malformed task YAML"
    elif case == "missing data file":
        tasks = str(_task_yaml(tmp_path, GOOD_TASK.replace("facts.jsonl", "absent.jsonl")))
        named = "task demo_facts (" + tasks + "): data file absent.jsonl not found"
    elif case == "hub dataset":
        tasks = str(_task_yaml(tmp_path, GOOD_TASK.replace("dataset_path: json", "dataset_path: someorg/facts")))
        named = "task demo_facts (" + tasks + ") needs dataset_path=someorg/facts from the Hugging Face Hub"
    else:
        tasks, named = str(tmp_path / "absent.yaml"), "task file " + str(tmp_path / "absent.yaml") + " not found"
    out = tmp_path / "results.json"
    code = harness.main(["--model", str(model), "--tasks", tasks, "--output", str(out), "--device", "cpu"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(err) == 1 and named in err[0], (code, err)
    assert not out.exists() and not list(tmp_path.glob("results.json*"))


def test_cli_exit_code_and_missing_extra(tmp_path, monkeypatch, capsys):
    """A real `python -m llmtrain.eval` exits 2 with the one line; without lm-eval installed the CLI and the
    library call name the extra."""
    res = subprocess.run([sys.executable, "-m", "llmtrain.eval", "--model", str(tmp_path / "nope"), "--tasks",
                          "x"], check=False, capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"error: --model {tmp_path / 'nope'}: no such directory"]
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    assert harness.main(["--model", str(tmp_path), "--tasks", "x"]) == 2
    assert capsys.readouterr().err.strip() == ("error: lm-evaluation-harness is not installed: "
                                               "pip install 'llmtrain[eval]'")
    with pytest.raises(harness.EvalError, match=r"pip install 'llmtrain\[eval\]'"):
        harness.score(tmp_path, None, ["x"])



@pytest.mark.slow
def test_harness_during_training_leaves_training_and_resume_exact(tmp_path, two_rank_run):
    """eval.harness every 2 steps on 2 ranks: harness/<task>/<metric> records at steps 2 and 4 (the last one the
    final export's), the losses of the same run without it (the two-rank run, tests/conftest.py) bit for bit,
    and a resume from the step-2 checkpoint (saved right after an eval) continues with the same losses."""
    harness = (f"eval.harness.tasks=[{DEMO_TASKS}]", "eval.harness.every_steps=2", f"eval.harness.limit={LIMIT}")
    two = TWO_RANKS
    run_recipe(tmp_path / "run", *two, *harness, "checkpoint.every_steps=2", nproc=2)
    records = read_metrics(tmp_path / "run")
    scored = [r for r in records if any(k.startswith("harness/") for k in r)]
    assert [r["step"] for r in scored] == [2, 4]
    assert {"harness/demo_facts/acc,none", "harness/demo_recall/exact_match,strip"} <= scored[-1].keys()
    with_harness = losses_by_step(tmp_path / "run")
    assert with_harness == losses_by_step(two_rank_run)
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step_2", tmp_path / "resumed" / "checkpoints" / "step_2")
    res = run_recipe(tmp_path / "resumed", *two, *harness, nproc=2)
    assert "resumed at step 2" in res.stdout
    assert {s: v for s, v in losses_by_step(tmp_path / "resumed").items()} == {3: with_harness[3], 4: with_harness[4]}
