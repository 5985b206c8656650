"""python -m llmtrain.tools.generate on the tiny reference run's export: its output equals llmtrain.tools.generate's
functions in process; the chat template's prompt and its end-of-turn stop token; a directory that is no model
exits 2."""

from __future__ import annotations

import pytest

from helpers.procs import launch


@pytest.mark.slow
def test_generate_cli_matches_transformers(reference_run):
    from llmtrain.tools import generate

    out = reference_run  # its export: out / "hf"
    res = launch(["-m", "llmtrain.tools.generate", "--model", out / "hf", "--prompt", "Hello there", "--chat",
                  "--max-new-tokens", "8"], timeout=120)
    assert res.returncode == 0, res.stderr
    model, tok = generate.load(str(out / "hf"), "cpu")
    inputs = generate.build_inputs(tok, "Hello there", chat=True)
    prompt = tok.decode(inputs["input_ids"][0])
    assert "<|start_header_id|>user<|end_header_id|>" in prompt and prompt.endswith("assistant<|end_header_id|>\n\n")
    assert res.stdout == generate.generate(model, tok, "Hello there", chat=True, max_new_tokens=8) + "\n"
    # A chat reply ends with its turn: the template's end-of-turn token stops generation, not only EOS.
    eot, eos = tok.convert_tokens_to_ids("<|eot_id|>"), tok.eos_token_id
    assert eot != eos and {eot, eos} <= set(generate.stop_token_ids(model, tok))
    assert {eot, eos} <= set(model.generation_config.eos_token_id)  # the export itself says where a turn ends
    plain = generate.generate(model, tok, "Hello there", max_new_tokens=8)
    ids = tok(plain, add_special_tokens=False)["input_ids"]
    assert 0 < len(ids) <= 8 or plain == ""
    assert generate.main(["--model", str(out), "--prompt", "x"]) == 2  # not a model directory
    assert generate.main(["--model", str(out / "hf"), "--prompt", "Hello there", "--max-new-tokens", "8"]) == 0
