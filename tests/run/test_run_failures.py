"""What the console says when a run is refused, loses a rank or is preempted under torchrun: one line that says
what happened and what is saved, once, newline-terminated, and nothing lost that the line does not name."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from helpers import RECIPE, REPO, TINY
from helpers.procs import (TWO_RANKS, finish, read_metrics, run_recipe, start, start_recipe, wait_for_step,
                           worker_pids)
from llmtrain.checkpoint import complete_checkpoints
from llmtrain.config import ConfigError, TrainConfig
from llmtrain.distributed import preemption_line
from llmtrain.optim import lr_at, warmup_note
from llmtrain.run.resume import check_budget


def lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_a_warmup_longer_than_the_run_is_said():
    short = TrainConfig(max_steps=4, warmup_steps=200, lr=1e-3)
    assert warmup_note(short) == ("warning: train.warmup_steps=200 is longer than the run (train.max_steps=4): the lr "
                                  "rises to 2% of its peak and never reaches it; set train.warmup_steps<=4 for the "
                                  "full schedule")
    assert lr_at(3, short, 1e-3) == pytest.approx(1e-3 * 4 / 200)  # what the line says: 2% at the last step
    assert warmup_note(TrainConfig(max_steps=10, warmup_steps=10)) is None  # reaches the peak at its last step


def test_max_steps_below_the_checkpoint_names_the_one_to_go_back_to(tmp_path):
    for step in (2, 4, 6):  # what complete_checkpoints counts as complete: the files written last
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "trainer_state.json").write_text("{}")
        (tmp_path / f"step_{step}" / ".metadata").write_text("")
    check_budget(tmp_path / "step_6", 6, 6)  # a finished run rerun: nothing to train, nothing refused
    with pytest.raises(ConfigError, match=re.escape(f"or go back with checkpoint.resume={tmp_path / 'step_4'}") + "$"):
        check_budget(tmp_path / "step_6", 6, 5)
    with pytest.raises(ConfigError, match=re.escape("(no checkpoint at or before step 1 to go back to: "
                                                    "checkpoint.resume=never starts afresh)")):
        check_budget(tmp_path / "step_6", 6, 1)


def test_a_preemption_line_says_what_a_short_grace_period_loses():
    fits = preemption_line("SIGTERM", 1, 6, 4, 2.0, (90.0, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"))
    assert fits == ("preemption signal SIGTERM (rank 1): finishing step 7, then saving; steps since the last "
                    "checkpoint (step 4) are lost if the grace period (90 s, TORCH_ELASTIC_SHUTDOWN_TIMEOUT) ends "
                    "first")
    long = preemption_line("SIGTERM", 0, 6, 4, 40.0, (30.0, "torchrun's default"))
    assert long.endswith("; a step took 40 s, longer than the grace period: this step will not finish and 3 steps "
                         "are lost")
    assert preemption_line("SIGUSR1", 0, 0, None, None, None).endswith(
        "steps since the last checkpoint (none yet) are lost if this process is killed before that")


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_printed_once(tmp_path):
    """Both ranks refuse the bad key alike: the console shows the line once, on a line of its own; torchrun's
    report shows it as each rank's cause, with each rank's exit code 2; torchrun itself exits 1, and the ranks'
    codes reach a wrapper through LLMTRAIN_EXIT_FILE (slurm/common.sh maps them)."""
    codes = tmp_path / "codes"
    codes.write_text("")
    res = finish(start([RECIPE, "--config", TINY, f"output_dir={tmp_path / 'out'}", "train.lrr=1"], nproc=2,
                       env={"LLMTRAIN_EXIT_FILE": str(codes)}), timeout=120)
    line = "error: unknown config key 'train.lrr'; did you mean 'train.lr'?"
    assert lines(res.stderr, "error") == [line], res.stderr
    # torchrun's report gives it as the cause, and exit code 2, of each rank that refused before torchrun stopped
    # the group (it SIGTERMs the others when the first fails: usually both refused by then, not always).
    assert 1 <= len(re.findall(rf"traceback : {re.escape(line)}\n", res.stderr)) <= 2, res.stderr
    assert 1 <= len(re.findall(r"exitcode\s*:\s*2 ", res.stderr)) <= 2 and res.returncode == 1
    assert codes.read_text() in ("2\n", "2\n2\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_slurm_template_exits_2_on_a_refusal(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    res = subprocess.run(["bash", str(REPO / "slurm" / "single_node.sh"), str(TINY), "train.lrr=1",
                          f"output_dir={tmp_path / 'out'}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**env, "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 2, res.stderr[-3000:]
    assert lines(res.stderr, "error") == ["error: unknown config key 'train.lrr'; did you mean 'train.lr'?"]
    assert "a rank refused its input (exit 2; the error line above says why): exiting 2" in res.stdout


@pytest.mark.slow
def test_max_steps_below_the_resumed_checkpoint_is_refused(tmp_path):
    """A 4-step run (its warm-up longer than the run, said at start) checkpointed at steps 2 and 4; rerun with
    train.max_steps=3: refused once, naming step_2 to go back to, and nothing of the run changes; going back as
    told works."""
    out, args = tmp_path / "run", (*TWO_RANKS, "checkpoint.every_steps=2", "train.warmup_steps=200")
    res = run_recipe(out, *args, nproc=2)
    assert lines(res.stdout, "warning: train.warmup_steps") == [
        "warning: train.warmup_steps=200 is longer than the run (train.max_steps=4): the lr rises to 2% of its peak "
        "and never reaches it; set train.warmup_steps<=4 for the full schedule"]
    assert read_metrics(out)[-1]["lr"] == pytest.approx(1e-3 * 4 / 200)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".llmtrain.lock"}
    res = run_recipe(out, *args, "train.max_steps=3", nproc=2, check=False, torchrun=True)
    ck = out / "checkpoints"
    assert lines(res.stderr, "error") == [
        f"error: train.max_steps=3 is below the step of the checkpoint it resumes from ({ck / 'step_4'}, step 4): it "
        "would train nothing and export step 4's weights. Raise train.max_steps above 4 to continue, or go back with "
        f"checkpoint.resume={ck / 'step_2'}"], res.stderr[-3000:]
    assert len(re.findall(r"exitcode\s*:\s*2 ", res.stderr)) == 2
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".llmtrain.lock"}
    assert after == before  # hf/, the checkpoints and metrics.jsonl as the 4-step run left them
    res = run_recipe(out, *args, "train.max_steps=3", f"checkpoint.resume={ck / 'step_2'}", nproc=2)
    assert "resumed at step 2" in res.stdout and read_metrics(out)[-1]["step"] == 3


@pytest.mark.slow
def test_a_killed_rank_is_named_with_the_newest_checkpoint(tmp_path):
    """Rank 1 is SIGKILLed mid-run: rank 0's one line says it lost its connection to rank 1, how rank 1 ended,
    where, and which checkpoint a rerun resumes from; gloo's raw text stays in errors-rank0.log."""
    proc = start_recipe(tmp_path, *TWO_RANKS, "parallel.strategy=ddp", "train.max_steps=100000",
                        "checkpoint.every_steps=2", nproc=2, torchrun=True)
    wait_for_step(tmp_path, 3, proc)
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    res = finish(proc, timeout=90)
    assert res.returncode == 1
    errors = lines(res.stderr, "error")
    assert len(errors) == 1, res.stderr[-3000:]
    newest = complete_checkpoints(tmp_path / "checkpoints")[-1][1]
    assert re.fullmatch(
        r"error: rank 0 lost its connection to a peer \(rank 1 (was killed by SIGKILL|is gone \(torchrun's report "
        r"says how it ended\))\) at (a collective|\w+) in (llmtrain|recipes)/\S+\.py:\d+ \(\w+\) `.+`; "
        r"newest checkpoint: "
        + re.escape(f"{newest} (a rerun resumes from it) (traceback in {tmp_path / 'errors-rank0.log'})"),
        errors[0]), errors[0]
    # gloo's raw text: "Connection reset by peer", or "Connection closed by peer ... a remote worker crashing" when
    # its read of the killed rank's socket ends without an error (seen once in a full run)
    raw = re.compile(r"Connection (reset|closed) by peer")
    assert not raw.search(res.stderr) and "pair.cc" not in res.stderr
    assert raw.search((tmp_path / "errors-rank0.log").read_text())
    assert "preemption signal" not in res.stderr  # torchrun's SIGTERM after a death is not a preemption


@pytest.mark.slow
@pytest.mark.parametrize("grace", ["env", "flag"])
def test_sigterm_to_torchrun_says_what_the_grace_period_covers(tmp_path, grace):
    """SIGTERM to torchrun (what a scheduler sends): it forwards it to the ranks and SIGKILLs them after its grace
    period. Each rank says at once which step it finishes, the checkpoint before it and the grace period it has
    (from TORCH_ELASTIC_SHUTDOWN_TIMEOUT or torchrun's --shutdown-timeout), then saves and exits 42."""
    codes = tmp_path / "codes"
    codes.write_text("")
    env = {"LLMTRAIN_EXIT_FILE": str(codes), **({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"} if grace == "env" else {})}
    flags = ("--shutdown-timeout=90",) if grace == "flag" else ()
    source = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" if grace == "env" else "torchrun --shutdown-timeout"
    proc = start([RECIPE, "--config", TINY, f"output_dir={tmp_path / 'out'}", *TWO_RANKS, "train.max_steps=100000",
                  "checkpoint.every_steps=3"], nproc=2, env=env, torchrun_args=flags)
    wait_for_step(tmp_path / "out", 4, proc)
    proc.send_signal(signal.SIGTERM)
    res = finish(proc, timeout=120)
    said = {}
    for rank in (0, 1):
        found = [m for line in res.stderr.splitlines() if (m := re.fullmatch(
            rf"preemption signal SIGTERM \(rank {rank}\): finishing step (\d+), then saving; steps since the last "
            rf"checkpoint \(step (\d+)\) are lost if the grace period \(90 s, {re.escape(source)}\) ends first",
            line))]
        assert len(found) == 1, res.stderr[-3000:]
        step, saved = map(int, found[0].groups())
        assert saved == (step - 1) // 3 * 3  # the newest checkpoint before the step it finishes
        said[rank] = step
        assert res.stderr.index(found[0].group(0)) < res.stderr.index("SignalException")  # said before the end
    # torchrun got the signal itself: it exits 1 with its SignalException, no report of the ranks' codes.
    assert res.returncode == 1 and "SignalException: Process" in res.stderr
    assert codes.read_text() == "42\n42\n"
    newest = complete_checkpoints(tmp_path / "out" / "checkpoints")[-1][0]
    assert min(said.values()) <= newest <= max(said.values()) + 1
    assert f"preempted: checkpoint step_{newest} saved; exiting with code 42 to be requeued" in res.stdout
