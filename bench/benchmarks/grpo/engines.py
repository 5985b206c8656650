"""GRPO rollout engines side by side: the `local` keyed sampler (llmtrain.rollout.local.generate) with compaction
(finished rows leave the batch) vs without (every row decodes to the batch's longest completion, as before),
in one process on the llama-32k shape (bench/configs/llama-32k.yaml's model, random weights), the demo prompts
(data/demo/prompts.jsonl, G = 4) and completions of up to --length (L) tokens with a realistic spread: the EOS
logit is set so that P(EOS) at completion token t is 4t / L^2 (a hazard rising with length: about 40% of the
completions stop before L/2, about 1 in 7 run to L).

    python bench/benchmarks/grpo/engines.py [--length 256] [--prompts 8] [--repeats 3] [--threads 2] [--quick] \\
        [--no-engines]

Prints, in markdown:
- compaction vs before: generated tokens/s (median over repeats, the modes alternating), the row-steps decoded
  (rows x forwards summed: the work, independent of the machine's load) and whether both modes sampled the same
  completions (token for token), after a short warm-up generation;
- the ceiling: a decode step's cost fitted as F + r x rows (1 row and all rows, whole length) and the most
  compaction can give with it for these lengths, and how small F would have to be for 1.5x;
- the engines (unless --no-engines): rollout.engine `local` vs `transformers` (continuous batching) vs transformers'
  generate (TRL's sampler), the EOS hazard off, each with the weights pushed as recipes/grpo.py pushes them, in
  alternating order, per call and median.
--quick: 64 tokens, 2 prompts, 1 repeat (a smoke run: it checks that the script works, its timings mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # gpu.engines: the engines' set-up, shared with the GPU suite

import torch  # noqa: E402
import yaml  # noqa: E402

from llmtrain.rollout.engine import Sampling  # noqa: E402
from llmtrain.rollout.local import generate  # noqa: E402
from llmtrain.rollout.section import RolloutSection  # noqa: E402

G, SEED = 4, 42


def build(length: int):
    """The llama-32k model (random weights, eval), the bundled tokenizer, and a hook that sets the EOS logit
    so that P(EOS) = 4t / length^2 at completion token t; it counts the rows of each forward."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    shape = yaml.safe_load((REPO / "bench" / "configs" / "llama-32k.yaml").read_text())["model"]["config"]
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    eos = tok.eos_token_id
    state = {"step": 0, "rows": 0, "hazard": True}

    def hook(module, args, logits):  # logits: [rows, 1, vocab] (logits_to_keep=1); step 0 is the prompt's
        state["step"] += 1
        state["rows"] += logits.shape[0]
        if state["hazard"]:
            hazard = min(4 * state["step"] / length**2, 1 - 1e-6)
            others = torch.cat([logits[..., :eos], logits[..., eos + 1:]], -1).logsumexp(-1)
            logits[..., eos] = others + math.log(hazard / (1 - hazard))
        return logits

    model.lm_head.register_forward_hook(hook)
    return model, tok, state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=256, help="max_completion_length")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch (each sampled G = 4 times)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="64 tokens, 2 prompts, 1 repeat: a smoke run")
    p.add_argument("--no-engines", action="store_true", help="the compaction table only")
    args = p.parse_args()
    if args.quick:
        args.length, args.prompts, args.repeats = 64, 2, 1
    torch.set_num_threads(args.threads)
    model, tok, state = build(args.length)
    lines = (REPO / "data" / "demo" / "prompts.jsonl").read_text().splitlines()[:args.prompts]
    prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in lines]
    rows = [p for p in prompts for _ in range(G)]
    keys = [(SEED, 0, i // G, i % G) for i in range(len(rows))]
    sampling = Sampling(args.length)
    cpu, pad = torch.device("cpu"), tok.pad_token_id or 0
    generate(model, rows, keys, Sampling(4), [tok.eos_token_id], pad, cpu)  # warm-up, untimed
    results: dict[str, list] = {"compaction": [], "no compaction (before)": []}
    for r in range(args.repeats):
        for name in (list(results) if r % 2 == 0 else list(results)[::-1]):
            state.update(step=0, rows=0)
            t0 = time.perf_counter()
            out = generate(model, rows, keys, sampling, [tok.eos_token_id], pad, cpu, compact=name == "compaction")
            results[name].append((time.perf_counter() - t0, out, state["rows"] - len(rows)))  # decode row-steps
    (_, a, work_a), (_, b, work_b) = results["compaction"][0], results["no compaction (before)"][0]
    same = torch.equal(a.ids, b.ids) and torch.equal(a.lengths, b.lengths)
    differing = int((a.ids != b.ids).sum()) if a.ids.shape == b.ids.shape else "shapes differ"
    lengths = a.lengths.float()
    print(f"llama-32k shape, {len(rows)} completions ({args.prompts} prompts x G {G}), max_completion_length "
          f"{args.length}, {args.threads} threads, {args.repeats} repeat(s), load average {os.getloadavg()[0]:.1f}")
    print(f"completion lengths: mean {lengths.mean():.0f}, min {int(lengths.min())}, max {int(lengths.max())}, "
          f"{int(a.truncated.sum())} of {len(rows)} truncated\n")
    print("| local engine | generated tokens/s | generation s | decode row-steps |")
    print("|---|---:|---:|---:|")
    rates = {}
    for name, runs in results.items():
        seconds = median(s for s, _, _ in runs)
        rates[name] = int(a.lengths.sum()) / seconds
        print(f"| {name} | {rates[name]:.0f} | {seconds:.2f} | {runs[0][2]} |")
    print(f"\ncompaction vs before: {rates['compaction'] / rates['no compaction (before)']:.2f}x generated "
          f"tokens/s, {work_b / max(work_a, 1):.2f}x fewer decode row-steps; same completions: {same} "
          f"(tokens differing: {differing})")
    state["hazard"] = False
    ceiling(model, tok, rows, keys, int(lengths.max()), state, work_a, work_b)
    if not args.no_engines:
        engines(model, tok, rows, keys, sampling, args.repeats)


def ceiling(model, tok, rows, keys, steps: int, state: dict, work_a: int, work_b: int) -> None:
    """What compaction can give on this machine: a decode step costs F + r x rows (F: reading the weights and
    the per-forward overhead, whatever the rows; r: each row's share), fitted from the time per step of 1 row and of
    all rows decoding `steps` tokens (the longest completion's: both modes take as many), so the best ratio is
    (steps F + row-steps before x r) / (steps F + row-steps with compaction x r)."""
    per_step = {}
    for n in (1, len(rows)):
        state.update(step=0)
        t0 = time.perf_counter()
        generate(model, rows[:n], keys[:n], Sampling(steps), [-1], tok.pad_token_id or 0, torch.device("cpu"))
        per_step[n] = (time.perf_counter() - t0) / state["step"]
    r = (per_step[len(rows)] - per_step[1]) / (len(rows) - 1)
    f = per_step[1] - r
    best = (steps * f + work_b * r) / (steps * f + work_a * r)
    print(f"\nA decode step here: {per_step[1] * 1e3:.1f} ms at 1 row, {per_step[len(rows)] * 1e3:.1f} ms at "
          f"{len(rows)}: F = {f * 1e3:.1f} ms + r = {r * 1e3:.2f} ms per row. At most {best:.2f}x from compaction "
          f"for these lengths ({work_b / max(work_a, 1):.2f}x if F were 0); 1.5x needs F <= "
          f"{(work_b - 1.5 * work_a) * r / (0.5 * steps) * 1e3:.1f} ms.")


def engines(model, tok, rows: list[list[int]], keys: list[tuple[int, ...]], sampling: Sampling, repeats: int) -> None:
    """rollout.engine local vs transformers (and transformers' generate, TRL's sampler), each with the weights pushed
    as recipes/grpo.py pushes them, in alternating order (A B C, then C B A, ...); the model's own EOS only."""
    from gpu.engines import engine_setup, hf_generate, process_group, pushed_engine

    cpu, eos, pad = torch.device("cpu"), [tok.eos_token_id], tok.pad_token_id or 0
    process_group(cpu)
    setup = engine_setup(model, eos, pad, cpu, rows, sampling.max_tokens, torch.float32,
                         str(REPO / "outputs" / "bench-grpo-engines"))

    def engine_call(engine):
        def call(n: int) -> tuple[list[list[int]], float]:
            out = engine.generate(rows, keys, Sampling(n))
            return out.tokens, out.seconds
        return call

    def hf_call(n: int) -> tuple[list[list[int]], float]:
        tokens, _, seconds = hf_generate(model, rows, Sampling(n), eos, pad, cpu)
        return tokens, seconds

    calls = {name: engine_call(pushed_engine(RolloutSection(engine=name), setup)) for name in ("local", "transformers")}
    calls["hf generate"] = hf_call
    for call in calls.values():
        call(4)  # warm-up
    runs: dict[str, list] = {name: [] for name in calls}
    for r in range(repeats):
        for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            tokens, seconds = calls[name](sampling.max_tokens)
            runs[name].append(sum(map(len, tokens)) / seconds)
    print(f"\nEngines (no EOS hazard: random weights, nearly every completion runs to {sampling.max_tokens}), "
          f"generated tokens/s per call, order alternating:\n")
    print("| engine | " + " | ".join(f"call {i + 1}" for i in range(repeats)) + " | median | vs local |")
    print("|---|" + "---:|" * (repeats + 2))
    local = median(runs["local"])
    for name, rates in runs.items():
        mid = median(rates)
        print(f"| {name} | " + " | ".join(f"{x:.0f}" for x in rates) + f" | {mid:.0f} | {mid / local:.2f}x |")
    pairs = [f"{a / b:.2f}" for a, b in zip(runs["transformers"], runs["local"])]
    print(f"\ntransformers / local per call: {', '.join(pairs)}; local / transformers (median): "
          f"{local / median(runs['transformers']):.2f}x")


if __name__ == "__main__":
    main()
