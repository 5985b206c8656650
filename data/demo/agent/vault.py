"""The agent demo's environment (configs/demo-agent.yaml, docs/agents.md): a vault whose code differs per episode and
is held here only, so a prompt is answered through the read_code tool or not at all."""


class Vault:
    def reset(self, prompt, answer, **row):
        """A new episode: this row's code (its `answer` column)."""
        self.code, self.reads = answer, 0

    def read_code(self) -> str:
        """Read the vault's code."""
        self.reads += 1
        return self.code
