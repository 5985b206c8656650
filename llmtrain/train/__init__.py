"""The recipes' shared body (llmtrain.recipes.base.Recipe drives it): cli (command line, checks, exit codes),
build (policy, optimizer, checkpoints, metrics, data, reference, export), step (the one micro-batch
accumulation, taking an Objective) and loop (the step loop)."""
