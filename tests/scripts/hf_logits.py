"""In a clean interpreter (no llmtrain import; tests/helpers/launcher.py forks it from a server that imported torch
and transformers only): load an exported directory with transformers and compute its logits on a fixed probe
batch. With --save, write them to PROBE (a baseline: input_ids and logits); otherwise print the max |logit
difference| against the baseline in PROBE and, given a PEFT adapter directory and its base, also that of the base
with the adapter loaded by PeftModel.from_pretrained (adapter_maxdiff=).
Usage: hf_logits.py --save HF_DIR PROBE | hf_logits.py HF_DIR PROBE [ADAPTER_DIR BASE_DIR]"""

import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

assert not any(m.split(".")[0] == "llmtrain" for m in sys.modules), "llmtrain is imported"
save = sys.argv[1] == "--save"
args = sys.argv[2:] if save else sys.argv[1:]
hf_dir, probe_path = args[:2]
model = AutoModelForCausalLM.from_pretrained(hf_dir)
tokenizer = AutoTokenizer.from_pretrained(hf_dir)
assert tokenizer.decode(tokenizer("the red ball")["input_ids"]) == "the red ball"
if save:
    input_ids = (torch.arange(2 * 24).reshape(2, 24) * 7919) % 500 + 6  # ordinary (non-special) token ids
    with torch.no_grad():
        save_file({"input_ids": input_ids, "logits": model(input_ids=input_ids).logits.contiguous()}, probe_path)
else:
    probe = load_file(probe_path)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    print(f"maxdiff={(logits - probe['logits']).abs().max().item():.3e}")
    if len(args) > 2:  # not with --save
        from peft import PeftModel, get_peft_model_state_dict

        adapter_dir, base_dir = args[2:4]
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
        saved, loaded = load_file(f"{adapter_dir}/adapter_model.safetensors"), get_peft_model_state_dict(model)
        assert saved.keys() == loaded.keys(), sorted(saved.keys() ^ loaded.keys())[:4]  # none missing or unexpected
        assert all(torch.equal(saved[k], v) for k, v in loaded.items()), "adapter not loaded"
        with torch.no_grad():
            logits = model(input_ids=probe["input_ids"]).logits
        print(f"adapter_maxdiff={(logits - probe['logits']).abs().max().item():.3e}")
assert not any(m.startswith("llmtrain") for m in sys.modules), "llmtrain was imported"
