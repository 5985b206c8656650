"""Command-line tools that are not part of a training run (python -m llmtrain.tools.<name> --help)."""
