"""End-to-end runs several tests read, each run once per pytest session: the `shared_runs` fixture
(tests/conftest.py) keys a run by what decides its result (script, ranks, launcher and the resolved config), so
two tests asking for the same run, however they spell its overrides, share one output directory. A shared
directory is read-only to the tests: one that writes into a run's output (a resume, a copied checkpoint) runs
its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from helpers import RECIPE, TINY
from helpers.procs import TWO_RANKS, finish_recipe, start_recipe


@dataclass(frozen=True)
class Run:
    overrides: tuple[str, ...] = ()
    nproc: int = 1
    script: Path = RECIPE
    config: Path = TINY
    torchrun: bool | None = None  # None: the fork server's children (helpers/launcher.py's spawn)

    def key(self) -> tuple:
        """What decides the run's result: the fine-tuning recipe's config resolved (so default values spelled
        out or overrides in another order name the same run); other scripts' overrides as given."""
        if self.script == RECIPE:
            from llmtrain.config import load_config, to_yaml

            settings = to_yaml(load_config(self.config, [*self.overrides, "output_dir=shared"]))
        else:
            settings = (self.config, tuple(self.overrides))
        return self.script, self.nproc, self.torchrun, settings


# The plainest run of the recipe (one process, no wrapper, micro 4, accum 1), its last step checkpointed.
REFERENCE = Run(("parallel.strategy=none", "checkpoint.every_steps=4"))
# The same global batch on 2 DDP processes (torchrun --standalone).
TWO_RANK = Run(TWO_RANKS, nproc=2)


class SharedRuns:
    """Runs by key, each started at most once (the first `get` of it), several side by side."""

    def __init__(self, root):
        self.root, self.done = root, {}  # root: a pytest TempPathFactory

    def get(self, runs: dict, at_once: int = 1) -> dict:
        """{name: Run} -> {name: output directory}: those not run yet in this session, `at_once` at a time."""
        todo = {}  # key -> (Run, output dir)
        for run in runs.values():
            if run.key() not in self.done and run.key() not in todo:
                todo[run.key()] = (run, self.root.mktemp("shared"))
        running = []
        for key, (run, out) in todo.items():
            if len(running) == at_once:
                self._finish(*running.pop(0))
            running.append((key, out, start_recipe(out, *run.overrides, nproc=run.nproc, config=run.config,
                                                   torchrun=run.torchrun, script=run.script)))
        for item in running:
            self._finish(*item)
        return {name: self.done[run.key()] for name, run in runs.items()}

    def _finish(self, key, out: Path, proc) -> None:
        finish_recipe(proc)
        self.done[key] = out

    def __call__(self, run: Run) -> Path:
        return self.get({None: run})[None]
