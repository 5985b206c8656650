"""In a clean interpreter (no llmtrain import): load an exported directory with transformers and print the
max |logit difference| against the saved probe; given a PEFT adapter directory and its base, also that of
the base with the adapter loaded by PeftModel.from_pretrained (adapter_maxdiff=).
Usage: hf_logits.py HF_DIR PROBE [ADAPTER_DIR BASE_DIR]"""

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
print(f"maxdiff={(logits - probe['logits']).abs().max().item():.3e}")
if len(sys.argv) > 3:
    from peft import PeftModel, get_peft_model_state_dict

    adapter_dir, base_dir = sys.argv[3:5]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    saved, loaded = load_file(f"{adapter_dir}/adapter_model.safetensors"), get_peft_model_state_dict(model)
    assert saved.keys() == loaded.keys(), sorted(saved.keys() ^ loaded.keys())[:4]  # none missing or unexpected
    assert all(torch.equal(saved[k], v) for k, v in loaded.items()), "adapter not loaded"
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    print(f"adapter_maxdiff={(logits - probe['logits']).abs().max().item():.3e}")
assert not any(m.startswith("llmtrain") for m in sys.modules), "llmtrain was imported"
