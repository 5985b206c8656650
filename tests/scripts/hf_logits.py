"""In a clean interpreter (no llmtrain import): load an exported directory with transformers and
print the max |logit difference| against the saved probe. Usage: hf_logits.py HF_DIR PROBE"""

import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

hf_dir, probe_path = sys.argv[1:3]
model = AutoModelForCausalLM.from_pretrained(hf_dir)
tokenizer = AutoTokenizer.from_pretrained(hf_dir)
assert tokenizer.decode(tokenizer("the red ball")["input_ids"]) == "the red ball"
probe = load_file(probe_path)
with torch.no_grad():
    logits = model(input_ids=probe["input_ids"]).logits
assert not any(m.startswith("llmtrain") for m in sys.modules), "llmtrain was imported"
print(f"maxdiff={(logits - probe['logits']).abs().max().item():.3e}")
