"""The shape of a recipe. A recipe is a Recipe subclass (one module or package of llmtrain.recipes each, named
in llmtrain.recipes.RECIPES) that says only what is its own: its name, its config class (a Config subclass
with its section), the kind of data rows it trains on, its set-up checks, its extra models and its
objective (built in setup: a reference, a teacher; an llmtrain.train.step.Objective), its batch source
(llmtrain.train.source: the data's micro-batches by default; GRPO's rollouts) with the name its state is
checkpointed under, if it has any, and its eval. Everything else (command line, model, optimizer, data,
checkpoints, resume, preemption, loop, export) is llmtrain.train's, the same for every recipe:

    class MyRecipe(Recipe):
        config_cls = MyConfig
        ...
    # recipes/my.py, the script users run:
    if __name__ == "__main__":
        distributed.hard_exit(MyRecipe().main())
"""

from __future__ import annotations

from torch import nn

from llmtrain import data
from llmtrain.config import Config, ConfigError
from llmtrain.models import hf
from llmtrain.train import cli, loop
from llmtrain.train.build import Registered, Run, build, build_data, data_source
from llmtrain.train.source import BatchSource, Held
from llmtrain.train.step import Objective


class Recipe:
    name: str             # what checkpoints record as the recipe (resume.identity); RECIPES' key
    config_cls: type[Config] = Config
    usage: str = ""
    rows: str = "tokens"  # the data kind it trains on (data.FORMATS[...].rows): "tokens" or "pairs"
    unit: str = "rows"    # what one sample of the global batch is, for the log
    final_export: bool = True  # write output_dir/hf (and adapter/) at the end
    score_head: bool = False   # the policy is a one-score sequence classifier (a reward model), not a causal LM
    sequence_parallel: bool = False  # its forwards run under parallel.sp_size > 1 (llmtrain.models.ulysses)
    per_token_logps: bool = False  # its objective reads per-token log-probs (liger's fused loss has none)
    run: Run              # set by setup
    objective: Objective  # set by the subclass's setup

    # -- before any process group ------------------------------------------------------------------
    def check(self, cfg: Config) -> None:
        """The recipe's own set-up checks (ConfigError naming the key), before the shared ones."""

    def check_existing_model(self, cfg: Config, demo_config: str) -> None:
        """For a recipe that tunes an existing model: a missing model.path says where the demo's comes from."""
        try:
            hf.check_paths(cfg.model, cfg.tokenizer.path)
        except ConfigError as e:
            raise ConfigError(f"{e} ({demo_config} starts from the SFT demo's export: run torchrun --standalone "
                              "--nproc_per_node=2 recipes/finetune.py --config configs/demo.yaml first)") from None

    def check_data(self, cfg: Config) -> None:
        kind = data.rows_kind(cfg.data).name
        if kind != self.rows:
            fitting = " or ".join(f"data.format={n}" for n, f in data.FORMATS.items() if f.rows.name == self.rows)
            raise ConfigError(f"data.format: {', '.join(sorted(data.formats_used(cfg.data)))} gives {kind} rows but "
                              f"this recipe trains on {self.rows}: set {fitting} (recipes/finetune.py trains on "
                              "token rows, recipes/dpo.py on pairs)")

    def source_state(self, cfg: Config) -> str | None:
        """The name the batch source's state_dict() is checkpointed under (state/<name>.json); None: it keeps
        nothing beyond its position (TrainState.data)."""
        return None

    # -- once the process group exists -------------------------------------------------------------
    def source(self, run: Run) -> tuple[data.Built | None, BatchSource]:
        """The data and where each step's micro-batches come from: by default this rank's share of the data's
        global batch."""
        built = build_data(run, self.unit)
        return built, data_source(run, built)

    def setup(self, run: Run, built: data.Built | None) -> None:
        """Extra models, the objective and anything else the steps need, once the policy and the data exist."""
        self.run = run

    def evaluate(self, at_step: int) -> dict:
        """Validation metrics at eval.every_steps (a collective); {} logs nothing."""
        return {}

    # -- the shared body ---------------------------------------------------------------------------
    def train(self, cfg: Config, env) -> nn.Module:
        name, held = self.source_state(cfg), Held()
        run = build(cfg, env, self.name, [Registered(name, held)] if name else [], self.score_head)
        built, source = self.source(run)
        try:
            self.setup(run, built)
            return loop.loop(run, held.load_into(source), self.objective, self.evaluate, self.final_export)
        finally:
            # What setup kept (the run, its model, a reference) goes with the run, before the process group
            # does: freed after it, DDP's reducer destroys the group itself and joins a gloo thread that waits
            # for the GIL the destructor holds (a hang at exit, seen at torch 2.13).
            vars(self).clear()

    def main(self, argv: list[str] | None = None) -> int:
        """Parse, check (this recipe's, then the shared ones), init, train; returns the exit code."""
        return cli.main(argv, self.usage, self.config_cls, self.train, self.setup_checks)

    def setup_checks(self, cfg: Config) -> None:
        if cfg.parallel.sp_size > 1 and not self.sequence_parallel:
            raise ConfigError(f"parallel.sp_size={cfg.parallel.sp_size}: sequence parallelism is not supported by "
                              f"the {self.name} recipe yet (recipes/finetune.py has it); use parallel.sp_size=1")
        if self.per_token_logps and cfg.train.loss_impl == "liger":
            raise ConfigError(f"train.loss_impl: recipes/{self.name}.py takes chunked (the default) or full; liger's "
                              "fused kernel yields only a summed loss, not the per-token log-probs it needs")
        self.check(cfg)
        self.check_data(cfg)
