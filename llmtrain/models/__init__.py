"""Models: hf (transformers glue: config, meta build, per-rank loading, tokenizer, family checks),
attention (which attention a family gets), lora (PEFT adapters). A new model family's quirks go here."""
