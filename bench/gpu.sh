#!/usr/bin/env bash
# bench/gpu.sh: one prepared GPU benchmark for a single lent GPU (written for one H200), <= 8 minutes.
#
# STATUS: NOT RUN ON A GPU YET. It was written and checked on a CPU-only machine (no GPU was lent to
# that session): `bash -n bench/gpu.sh` and the whole script in dry-run mode
# (`bash bench/gpu.sh --cpu-smoke`: gloo, a tiny model, fp32/bf16 on CPU, also with `datasets`
# unimportable). Its first GPU run is its real test; read the log before trusting the table.
#
#   bash bench/gpu.sh                  # results in $RESULTS (default: $OUT if set, else outputs/bench-gpu)
#   BUDGET_S=450 STEPS=30 bash bench/gpu.sh
#
# What it does, in order, each step bounded so that the whole script ends within BUDGET_S (450 s):
#   1. environment: GPU name and memory, torch / CUDA / transformers versions
#   2. checks (bench/gpu/checks.py): a 1-rank NCCL group (all_reduce, broadcast, barrier; two NCCL
#      ranks cannot share one GPU), bf16 matmul + autocast, torch.compile forward/backward
#   3. throughput: recipes/finetune.py, through bench/gpu/train.py (the recipe unchanged but fed
#      random token batches and without the final export, so `datasets` is not needed: GPU machines
#      have torch, transformers, accelerate, safetensors but not datasets), config bench/gpu/gpu-1b.yaml:
#      a ~1.2B Llama (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocab 128256),
#      seq_len 2048, micro-batch 4, FSDP2 + bf16, 1 GPU. Four runs: eager, compile, activation
#      checkpointing, both; and LoRA r=16 on a bf16 base vs QLoRA (NF4 base), after eager. tokens/s
#      and MFU (peak from llmtrain.metrics.PEAK_TFLOPS by GPU name,
#      H200: 989.4 bf16 TFLOP/s dense) are the recipe's own metrics, after 10 warm-up steps.
#   4. GRPO engines (bench/gpu/engines.py, no `datasets` needed): the same model (bf16, random init), 16 rows
#      (2 demo prompts x G 8) of 128 tokens, generated tokens/s of HF generate (the baseline), then each
#      rollout.engine (local, transformers, vllm; vllm skipped with a line when not importable) built through the
#      registry, its weights pushed and fingerprint-checked as recipes/grpo.py does; a table and the line
#      "vllm / hf generate: R x (target >= 5x ...)"; also $RESULTS/engines/results.json
#   5. GRPO (recipes/grpo.py, needs `datasets`): one run per engine (vllm when importable), the same model
#      sampling 16 x 128 tokens a step; generation vs step time and generated tokens/s per step, from its
#      metrics.jsonl (not run on a GPU yet either)
#   6. a markdown table of the throughput runs (bench/gpu/train.py --table), also saved to $RESULTS/table.md
#   longctx (not in the default SECTIONS: it needs a node of up to 8 GPUs, not one lent GPU; not run on a GPU yet):
#      the same model on one 32768-token row per data-parallel rank, activation checkpointing, Ulysses
#      parallel.sp_size 1, 2, 4, 8 on as many GPUs (those the node has), and sp_size 1 with
#      train.activation_offloading; tokens/s and peak memory per GPU in the table (docs/long-context.md: memory
#      arithmetic of configs/llama3.2-1b-32k-sp.yaml)
#   GPU work not done yet: ring attention (a `parallel.sp_backend=ring` beside Ulysses' all-to-all), for
#      sequence groups larger than the attention heads; not implemented (docs/long-context.md, Limits).
#
# SECTIONS picks what runs (default all): e.g. SECTIONS="engines" bash bench/gpu.sh for the engines alone;
# SECTIONS=longctx bash bench/gpu.sh on an 8-GPU node for the long-context rows.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python}
TORCHRUN=${TORCHRUN:-torchrun}
RESULTS=${RESULTS:-${OUT:-outputs/bench-gpu}}
BUDGET_S=${BUDGET_S:-450}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-10}
CONFIG=bench/gpu/gpu-1b.yaml
SECTIONS=${SECTIONS:-checks throughput engines grpo}
SMOKE=0
EXTRA=()
if [[ "${1:-}" == "--cpu-smoke" ]]; then
  # Dry run on CPU: the same script and code paths with a tiny model, to catch mistakes before a GPU.
  SMOKE=1
  STEPS=6
  WARMUP=2
  EXTRA=(distributed.device=cpu model.config.hidden_size=64 model.config.intermediate_size=128
         model.config.num_hidden_layers=2 model.config.num_attention_heads=4 model.config.num_key_value_heads=2
         model.config.vocab_size=1024 data.seq_len=64 train.micro_batch_size=2 log.every_steps=2)
fi
mkdir -p "$RESULTS"
start=$SECONDS
left() { echo $(( BUDGET_S - (SECONDS - start) )); }
wanted() { [[ " $SECTIONS " == *" $1 "* ]]; }

echo "== environment"
if [[ $SMOKE == 0 ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed"
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| transformers', transformers.__version__, '| GPUs', torch.cuda.device_count())"
$PY -c "import datasets" 2>/dev/null && echo "datasets: installed (not needed)" || echo "datasets: not installed (not needed)"

if wanted checks; then
echo "== checks"
timeout 120 $PY bench/gpu/checks.py $([[ $SMOKE == 1 ]] && echo --allow-cpu) 2>"$RESULTS/checks.err" | tee "$RESULTS/checks.txt"
checks_rc=${PIPESTATUS[0]}
[[ $checks_rc == 0 ]] || echo "checks: exit $checks_rc (see $RESULTS/checks.err); continuing with the throughput runs"
fi

dirs=()
if wanted throughput; then
echo "== throughput: $CONFIG, $STEPS steps, table after $WARMUP warm-up steps"
# lora / qlora: LoRA r=16 on a bf16 base vs QLoRA (lora.quantize_base=nf4, needs peft and torchao: a missing
# package ends that row at start with the pip line); their tokens/s ratio is the GPU's QLoRA step-time cost
# (CPU: bench/benchmarks/lora/qlora.py; torchtune's published GPU ratio is ~1.28x).
LORA="lora.enabled=true lora.r=16 lora.alpha=32 lora.dropout=0 lora.base_dtype=bf16 lora.export=adapter"
variants=("eager|"
          "lora|$LORA"
          "qlora|$LORA lora.quantize_base=nf4"
          "compile|parallel.compile=true"
          "ac|parallel.activation_checkpointing=true"
          "ac+compile|parallel.activation_checkpointing=true parallel.compile=true")
for v in "${variants[@]}"; do
  name=${v%%|*}
  overrides=${v#*|}
  cap=120
  [[ $name == *compile* ]] && cap=150
  remaining=$(( $(left) - 20 ))  # keep 20 s for the table
  if (( remaining < 45 )); then
    echo "-- $name: skipped, ${remaining}s left of BUDGET_S=$BUDGET_S"
    continue
  fi
  limit=$(( remaining < cap ? remaining : cap ))
  out="$RESULTS/$name"
  rm -rf "$out"
  echo "-- $name ($overrides) limit ${limit}s"
  t0=$SECONDS
  # shellcheck disable=SC2086
  timeout -k 5 "$limit" $TORCHRUN --standalone --nproc_per_node=1 bench/gpu/train.py --config "$CONFIG" \
      output_dir="$out" train.max_steps="$STEPS" checkpoint.resume=never $overrides "${EXTRA[@]}" \
      >"$out.log" 2>&1
  rc=$?
  rm -rf "$out/checkpoints"  # a timeout's SIGTERM makes the recipe start a preemption save: drop it
  echo "   exit $rc after $(( SECONDS - t0 ))s; last lines of $out.log:"
  grep -E "^(model:|step |error)" "$out.log" | tail -n 3 | sed 's/^/   /'
  (( rc == 0 )) || tail -n 5 "$out.log" | sed 's/^/   /'
  dirs+=("$out")
done
fi

if wanted longctx; then
LONG_SEQ=${LONG_SEQ:-32768}
[[ $SMOKE == 1 ]] && LONG_SEQ=64
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
[[ $SMOKE == 1 ]] && NGPU=2
echo "== long context: $CONFIG, rows of $LONG_SEQ tokens, parallel.sp_size 1 2 4 8 (up to $NGPU GPUs), 1 offloaded"
for run in 1 1-offload 2 4 8; do
  sp=${run%-offload}
  offload=false
  [[ $run == *-offload ]] && offload=true
  remaining=$(( $(left) - 20 ))
  if (( sp > NGPU )); then
    echo "-- sp$run: skipped, $NGPU GPUs"
    continue
  elif (( remaining < 45 )); then
    echo "-- sp$run: skipped, ${remaining}s left of BUDGET_S=$BUDGET_S"
    continue
  fi
  out="$RESULTS/longctx-sp$run"
  rm -rf "$out"
  echo "-- sp$run on $sp GPUs, limit $(( remaining < 150 ? remaining : 150 ))s"
  timeout -k 5 "$(( remaining < 150 ? remaining : 150 ))" $TORCHRUN --standalone --nproc_per_node=$sp \
      bench/gpu/train.py --config "$CONFIG" output_dir="$out" train.max_steps="$STEPS" checkpoint.resume=never \
      "${EXTRA[@]}" data.seq_len="$LONG_SEQ" model.config.max_position_embeddings="$LONG_SEQ" \
      train.micro_batch_size=1 parallel.sp_size=$sp train.activation_offloading=$offload \
      parallel.activation_checkpointing=true >"$out.log" 2>&1
  rc=$?
  rm -rf "$out/checkpoints"
  echo "   exit $rc; last lines of $out.log:"
  grep -E "^(model:|step |error)" "$out.log" | tail -n 3 | sed 's/^/   /'
  dirs+=("$out")
done
fi

if wanted engines; then
echo "== grpo engines: bench/gpu/engines.py on the $CONFIG model, 2 demo prompts x G 8, 128 tokens"
remaining=$(( $(left) - 20 ))
if (( remaining < 60 )); then
  echo "-- engines: skipped, ${remaining}s left of BUDGET_S=$BUDGET_S"
else
  timeout -k 5 "$(( remaining < 300 ? remaining : 300 ))" $PY bench/gpu/engines.py --out "$RESULTS/engines" \
      $([[ $SMOKE == 1 ]] && echo --cpu-smoke) 2>"$RESULTS/engines.err" | tee "$RESULTS/engines.txt"
  rc=${PIPESTATUS[0]}
  (( rc == 0 )) || { echo "   exit $rc; last lines of $RESULTS/engines.err:"; tail -n 5 "$RESULTS/engines.err" | sed 's/^/   /'; }
fi
fi

if wanted grpo; then
echo "== grpo: recipes/grpo.py per rollout.engine on the $CONFIG model, demo prompts, G 8, 128 new tokens, 4 steps"
# Needs `datasets` (prompts go through llmtrain.data); generation vs training time from its metrics.jsonl.
engines=(local transformers)
if $PY -c "import vllm" 2>/dev/null; then engines+=(vllm); else echo "-- grpo vllm: skipped, vllm not importable"; fi
for engine in "${engines[@]}"; do
  remaining=$(( $(left) - 20 ))
  if ! $PY -c "import datasets" 2>/dev/null; then
    echo "-- grpo: skipped, datasets not installed"
    break
  elif (( remaining < 60 )); then
    echo "-- grpo $engine: skipped, ${remaining}s left of BUDGET_S=$BUDGET_S"
    continue
  fi
  out="$RESULTS/grpo-$engine"
  rm -rf "$out"
  # shellcheck disable=SC2086
  timeout -k 5 "$(( remaining < 150 ? remaining : 150 ))" $TORCHRUN --standalone --nproc_per_node=1 recipes/grpo.py \
      --config "$CONFIG" output_dir="$out" "${EXTRA[@]}" data.path=data/demo/prompts.jsonl data.format=prompt \
      data.seq_len=64 train.max_steps=4 train.micro_batch_size=16 grpo.num_generations=8 \
      grpo.max_completion_length=128 "grpo.reward_funcs=[llmtrain.rewards:format_regex]" checkpoint.resume=never \
      rollout.engine="$engine" >"$out.log" 2>&1
  echo "-- grpo $engine: exit $?; generation vs step time per step:"
  $PY -c "import json,sys; [print(f'   step {r[\"step\"]}: generation {r[\"generation_s\"]:.2f}s of {r[\"step_time_s\"]:.2f}s, {r[\"generated_tokens_per_s\"]:.0f} generated tok/s, mem {r[\"mem_gb\"]:.1f} GB') for r in map(json.loads, open(sys.argv[1])) if 'loss' in r]" "$out/metrics.jsonl" 2>/dev/null || tail -n 5 "$out.log"
done
fi

echo "== results ($(( SECONDS - start ))s so far)"
if (( ${#dirs[@]} )); then
  $PY bench/gpu/train.py --table --warmup "$WARMUP" "${dirs[@]}" | tee "$RESULTS/table.md"
fi
echo "total $(( SECONDS - start ))s (budget ${BUDGET_S}s)"
