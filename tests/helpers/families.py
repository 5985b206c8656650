"""The tested model families: a tiny random model per family, built from its transformers config and saved
with save_pretrained next to a tokenizer (the bundled one plus the family's chat tokens and its published
chat template). Used by tests/models/test_families.py and tests/scripts/family_matrix.py."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma3TextConfig, LlamaConfig,
                          MistralConfig, Phi3Config, Qwen2Config, Qwen3Config)

REPO = Path(__file__).resolve().parents[2]

# The families' published templates (tool and reasoning branches left out). Gemma has no system role:
# Gemma3's merges a system message into the first user turn, Gemma2's (like Mistral's) refuses it.
CHATML = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
          "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
          "{%- endif %}{%- for message in messages %}{%- if message['role'] != 'system' or not loop.first %}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen3's, without tools: no default system prompt; the last answer gets an empty reasoning block.
QWEN3 = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
         "'<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message['role'] == 'user' or "
         "(message['role'] == 'system' and not loop.first) %}{{- '<|im_start|>' + message['role'] + '\\n' + "
         "message['content'] + '<|im_end|>\\n' }}{%- elif message['role'] == 'assistant' %}"
         "{{- '<|im_start|>assistant\\n' }}{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
         "{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
         "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
GEMMA3 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content']"
          " + '\\n\\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
          "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
          "{% endif %}{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
          "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
GEMMA2 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
          "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
          "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")
PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
        "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}"
           "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

CHAT = {  # family -> (template, its special tokens); None: the bundled Llama-3-style template
    "llama": (None, []), "llama_tied": (None, []),
    "mistral": (MISTRAL, []),
    "qwen2": (CHATML, ["<|im_start|>", "<|im_end|>"]),
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]),
    "gemma2": (GEMMA2, ["<start_of_turn>", "<end_of_turn>"]), "gemma3": (GEMMA3, ["<start_of_turn>", "<end_of_turn>"]),
    "phi3": (PHI3, ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
}

# hidden 64, 4 heads: Qwen3 and Gemma use head_dim 32 (heads x head_dim = 128 != hidden); the Gemmas and Mistral
# get a sliding window shorter than a row, so that their local-attention masks are exercised.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SHAPE, tie_word_embeddings=False),
    "llama_tied": lambda: LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**SHAPE, sliding_window=16),
    "qwen2": lambda: Qwen2Config(**SHAPE),
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=32),
    "gemma2": lambda: Gemma2Config(**SHAPE, head_dim=32, sliding_window=16),
    "gemma3": lambda: Gemma3TextConfig(**SHAPE, head_dim=32, sliding_window=16,
                                       layer_types=["sliding_attention", "full_attention"]),
    "phi3": lambda: Phi3Config(**SHAPE),
}
FAMILIES = list(CONFIGS)


def family_tokenizer(family: str):
    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tokenizer")
    template, special = CHAT[family]
    if special:
        tok.add_special_tokens({"additional_special_tokens": special})
    if template:
        tok.chat_template = template
    return tok


def make_family(family: str, path: Path, seed: int = 0) -> Path:
    """A random tiny model of `family` with its tokenizer, saved to `path` as a Hugging Face directory."""
    config = CONFIGS[family]()
    config.save_pretrained(path)
    family_tokenizer(family).save_pretrained(path)
    # Loaded back next to its config.json, transformers may pick the family's tokenizer class, which can add
    # tokens of its own (Qwen2's <|endoftext|>): the vocabulary must cover what a user's run will load.
    tok = AutoTokenizer.from_pretrained(path)
    config.vocab_size = len(tok)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path
