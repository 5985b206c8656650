"""In a clean interpreter (no llmtrain import): load an exported directory with transformers (and, given
ADAPTER_DIR, a PEFT adapter on top with PeftModel.from_pretrained) and print the max |logit difference|
against the saved probe. Usage: hf_logits.py HF_DIR PROBE [ADAPTER_DIR]"""

import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

hf_dir, probe_path = sys.argv[1:3]
model = AutoModelForCausalLM.from_pretrained(hf_dir)
if len(sys.argv) > 3:
    from peft import PeftModel, get_peft_model_state_dict

    model = PeftModel.from_pretrained(model, sys.argv[3])
    saved, loaded = load_file(f"{sys.argv[3]}/adapter_model.safetensors"), get_peft_model_state_dict(model)
    assert saved.keys() == loaded.keys(), (sorted(saved.keys() ^ loaded.keys())[:4])
    assert all(torch.equal(saved[k], v) for k, v in loaded.items()), "adapter not loaded"
tokenizer = AutoTokenizer.from_pretrained(hf_dir)
assert tokenizer.decode(tokenizer("the red ball")["input_ids"]) == "the red ball"
probe = load_file(probe_path)
with torch.no_grad():
    logits = model(input_ids=probe["input_ids"]).logits
assert not any(m.startswith("llmtrain") for m in sys.modules), "llmtrain was imported"
print(f"maxdiff={(logits - probe['logits']).abs().max().item():.3e}")
