"""Try a model: complete a prompt with transformers' generate.

    python -m llmtrain.tools.generate --model OUTPUT_DIR/hf --prompt "Once upon a time" [--max-new-tokens N]
    python -m llmtrain.tools.generate --model OUTPUT_DIR/hf --prompt "Hi!" --chat [--system "..."]

    python -m llmtrain.tools.generate --model OUTPUT_DIR/hf --image photo.png --prompt "What colour is it?"

--chat wraps the prompt as a user turn with the tokenizer's chat template (and asks for the
assistant's turn); without it the prompt is continued as plain text. --image (a vision-language export,
docs/vision.md): the image and the prompt make the user turn, rendered by the model's processor (--chat
implied). Greedy by default; --temperature > 0 samples (with --top-p, --seed). Prints the completion only."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DTYPES = ("auto", "fp32", "bf16", "fp16")


def build_inputs(tokenizer, prompt: str, chat: bool, system: str | None = None) -> dict:
    """input_ids (and attention_mask) for one prompt, as a batch of one."""
    if not chat:
        return dict(tokenizer(prompt, return_tensors="pt"))
    if not tokenizer.chat_template:
        raise ValueError("--chat: this tokenizer has no chat template (tokenizer_config.json / chat_template.jinja); "
                         "drop --chat to continue plain text")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template writes the special tokens (BOS included) itself.
    return dict(tokenizer(text, return_tensors="pt", add_special_tokens=False))


def build_image_inputs(processor, prompt: str, image: str, system: str | None = None) -> dict:
    """The processor's tensors for one user turn of an image and the prompt (asking for the assistant's turn)."""
    from PIL import Image

    with Image.open(image) as opened:
        picture = opened.convert("RGB")
    messages = ([{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []) + \
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    return dict(processor.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True,
                                              processor_kwargs={"images": [picture], "return_tensors": "pt"}))


def stop_token_ids(model, tokenizer) -> list[int]:
    """The model's EOS ids, the tokenizer's and the end-of-turn token of its chat template (an llmtrain export's
    generation config lists them all; an export made elsewhere may not), so that a reply ends with its turn."""
    from llmtrain.models.hf import stop_ids

    return stop_ids(model.generation_config.eos_token_id, tokenizer)


def generate(model, tokenizer, prompt: str, chat: bool = False, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, system: str | None = None, image: str | None = None) -> str:
    """tokenizer: a vision-language model's processor with `image`."""
    import torch

    inputs = build_image_inputs(tokenizer, prompt, image, system) if image else \
        build_inputs(tokenizer, prompt, chat, system)
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's own tokenizer decodes
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=stop_token_ids(model, tokenizer),
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                             else tokenizer.eos_token_id, **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def load(model_dir: str, device: str = "auto", dtype: str = "auto", image: bool = False,
         trust_remote_code: bool = False):
    """(model, tokenizer), or with image (a vision-language export) (model, its processor)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from llmtrain.utils import DTYPES as TORCH_DTYPES

    hf_logging.disable_progress_bar()  # stdout/stderr carry the completion and errors only
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = "auto" if dtype == "auto" else TORCH_DTYPES[dtype]
    if image:
        tokenizer = AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch_dtype).to(device)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device)
    model.eval()
    return model, tokenizer


def is_vision_dir(model_dir: str) -> bool:
    """A vision-language model directory (its config.json's model_type)."""
    from llmtrain.models import hf, vision

    return vision.is_vision_type(hf.model_type(model_dir))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrain.tools.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--model", required=True, help="a Hugging Face model directory, e.g. OUTPUT_DIR/hf")
    p.add_argument("--prompt", required=True, help="the text to continue, or the user message with --chat")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--system", help="--chat: a system message before the prompt")
    p.add_argument("--image", help="an image file the prompt asks about (a vision-language export)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="--image: allow the export's own processor code (only for models you trust)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: the dtype the weights were saved in")
    args = p.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        print(f"error: --model {args.model} is not a Hugging Face model directory (no config.json)", file=sys.stderr)
        return 2
    if args.image is not None and not Path(args.image).is_file():
        print(f"error: --image {args.image}: no such file", file=sys.stderr)
        return 2
    if args.image is not None and not is_vision_dir(args.model):
        print(f"error: --image: {args.model} is a text-only model (config.json's model_type); --image needs a "
              "vision-language model (docs/vision.md)", file=sys.stderr)
        return 2
    if args.max_new_tokens < 1:
        print("error: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2

    import torch

    torch.manual_seed(args.seed)
    model, tokenizer = load(args.model, args.device, args.dtype, args.image is not None, args.trust_remote_code)
    try:
        text = generate(model, tokenizer, args.prompt, args.chat, args.max_new_tokens, args.temperature, args.top_p,
                        args.system, args.image)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
