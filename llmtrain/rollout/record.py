"""What a generation batch leaves in the run's records: TRL's completion metrics (completion_metrics, every rank's
completions) and, every log.completions_every_steps generation batches, sampled completions with their rewards and
advantages in output_dir/completions.jsonl (CompletionLog)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed import ReduceOp

from llmtrain import distributed
from llmtrain.losses.policy import Advantages
from llmtrain.rollout.engine import Completions

LOGGED_PROMPTS = 4  # prompts (each with all its completions) per completions.jsonl record set


def completion_metrics(out: Completions, device: torch.device) -> dict[str, float]:
    """Collective (every rank, each with as many completions): TRL's completions/mean_length, /min_length,
    /max_length and /clipped_ratio (no EOS within the budget) over every rank's completions, generation_s (the
    slowest rank's sampling time) and generated_tokens_per_s (every rank's tokens over it). A multi-turn
    trajectory's length counts the model's tokens only (its tool_mask, as TRL)."""
    own = out.tool_mask or out.tokens
    lengths = distributed.gather_rows(torch.tensor([sum(m) if out.tool_mask else len(m) for m in own],
                                                   device=device)).cpu()
    truncated = distributed.gather_rows(torch.tensor(out.truncated, device=device).long()).cpu()
    seconds = distributed.all_reduce(torch.tensor(out.seconds, device=device), ReduceOp.MAX).item()
    return {"completions/mean_length": lengths.float().mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.float().mean().item(),
            "generation_s": seconds, "generated_tokens_per_s": lengths.sum().item() / max(seconds, 1e-9)}


def tool_metrics(calls: int, failures: int, turns: list[int], device: torch.device) -> dict[str, float]:
    """Collective: TRL's tools/call_frequency (tool calls per trajectory) and tools/failure_frequency (failed calls
    per call), and tools/mean_turns (sampled turns per trajectory), over every rank's trajectories."""
    sums = distributed.all_reduce(torch.tensor([calls, failures, sum(turns), len(turns)], dtype=torch.float64,
                                               device=device)).tolist()
    return {"tools/call_frequency": sums[0] / sums[3], "tools/failure_frequency": sums[1] / sums[0] if sums[0] else 0.0,
            "tools/mean_turns": sums[2] / sums[3]}


class CompletionLog:
    """output_dir/completions.jsonl (written by rank 0): per logged generation batch, the first LOGGED_PROMPTS
    prompts' completions (num_generations each), their rewards by function, reward and advantage; a multi-turn
    trajectory also as its messages (assistant turns with their tool_calls, tool results)."""

    def __init__(self, output_dir: str, is_main: bool, num_generations: int, reward_names: list[str]):
        self.path, self.is_main = Path(output_dir) / "completions.jsonl", is_main
        self.G, self.names = num_generations, reward_names

    def write(self, step: int, batch: dict, rows: range, texts: list[str], out: Completions, per_func: torch.Tensor,
              adv: Advantages, messages: list[list[dict]] | None = None) -> None:
        """Collective: this rank's completions (rows, in the global order, of the step's prompts `batch`) among the
        logged ones, every rank's written in order."""
        G = self.G
        records = [{"step": step, "prompt_index": int(batch["prompt_index"][c // G]), "generation": c % G,
                    "prompt": batch["prompts"][c // G], "completion": text, "tokens": len(ids), "truncated": cut,
                    "rewards": {n: None if v != v else v for n, v in zip(self.names, scores.tolist())},
                    "reward": float(adv.rewards[c]), "advantage": float(adv.advantages[c]),
                    **({"messages": messages[c - rows.start], "tool_tokens": mask.count(0)} if messages else {})}
                   for c, text, ids, cut, scores, mask in zip(rows, texts, out.tokens, out.truncated, per_func,
                                                              out.tool_mask or out.tokens)
                   if c // G < LOGGED_PROMPTS]
        parts = distributed.gather_objects(records)
        if self.is_main:
            with open(self.path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for part in parts for r in part)
