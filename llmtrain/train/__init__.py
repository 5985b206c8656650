"""The recipes' shared body: cli (command line, checks, exit codes), build (model, optimizer, checkpoint,
metrics, data, export) and loop (the step loop, taking the recipe's step function). A recipe adds its own
config section, step, eval and metrics."""

from llmtrain.train.build import Run, build, build_frozen, build_model, data_steps, export
from llmtrain.train.cli import Preempted, main, parse_args, setup
from llmtrain.step import StepResult
from llmtrain.train.loop import loop

__all__ = ["Preempted", "Run", "StepResult", "build", "build_frozen", "build_model", "data_steps", "export", "loop",
           "main", "parse_args", "setup"]
