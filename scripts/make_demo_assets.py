"""Generate the small demo dataset and tokenizer that ship with the repo.

Run from the repo root (no network, takes a few seconds):

    python scripts/make_demo_assets.py              # writes data/demo/* and assets/tokenizer/*
    python scripts/make_demo_assets.py --out DIR    # same files under DIR instead

Outputs:
    data/demo/train.jsonl, val.jsonl   {"text": ...}                          plain-text pretraining
    data/demo/instruct.jsonl           {"instruction", "input", "output"}     Alpaca style
    data/demo/chat.jsonl               {"messages": [{"role", "content"}]}    OpenAI style
    data/demo/sharegpt.jsonl           {"conversations": [{"from", "value"}]} ShareGPT style
    data/demo/preference.jsonl         {"prompt", "chosen", "rejected"}       preference pairs (DPO)
    data/demo/unpaired.jsonl           {"prompt", "completion", "label"}      the pairs unpaired (KTO): every
                                                                              chosen (true), then every rejected
    data/demo/reward.jsonl             {"prompt", "chosen", "rejected"}       more pairs of the same kinds, for
                                                                              the reward-model demo
    data/demo/vlm/train.jsonl, val.jsonl  {"messages", "images"}              questions about images/*.png (the
                                                                              colour and the size of their
                                                                              shape), held-out images in val
    assets/tokenizer/                  512-token byte-level BPE, loadable with AutoTokenizer
    assets/vlm/                        a tiny random LLaVA (CLIP tower, Llama decoder) with its processor (the
                                       tokenizer above plus <image>), for configs/demo-vlm.yaml

The text is synthetic English about a tiny fixed "world" (people, places, objects, colours,
numbers). Facts are fixed (the ball is always the same colour, arithmetic is always right), so
even a 2-layer model has something to learn beyond sentence templates and its loss falls fast.
Everything derives from SEED and the output is byte-for-byte reproducible;
tests/repo/test_demo_assets.py regenerates into a temp dir and compares with the shipped files.
"""

import argparse
import json
import os
import random
from pathlib import Path

# BPE training runs on a rayon thread pool; pin it to one thread so the learned merges can never
# depend on scheduling. This must happen before `tokenizers` is imported.
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SEED = 20240601
VOCAB_SIZE = 512
N_TRAIN, N_VAL, N_INSTRUCT, N_CHAT, N_SHAREGPT = 3000, 200, 600, 600, 100
N_PREFERENCE = 1000
N_REWARD = 3000  # the reward demo needs more count pairs than DPO to reach 0.9 held out (docs/preference.md)
N_VLM_TRAIN, N_VLM_VAL = 200, 50  # images; each is asked every question

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
START_HEADER, END_HEADER, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START_HEADER, END_HEADER, EOT]  # ids 0..5, in this order

# Llama-3 layout. BOS comes from the template (like Llama 3) because the tokenizer never adds it
# itself. Content is not trimmed, so the assistant mask covers exactly the message text.
# {% generation %} marks the assistant content + <|eot_id|> for return_assistant_tokens_mask.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- message['content'] + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# ----------------------------------------------------------------------------- the world
NUM = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
       "fifteen sixteen seventeen eighteen nineteen twenty").split()
PEOPLE = {"Anna": "she", "Ben": "he", "Cara": "she", "Dan": "he", "Eva": "she", "Finn": "he",
          "Gina": "she", "Hugo": "he", "Ivy": "she", "Jack": "he", "Lena": "she", "Omar": "he"}
OBJ_PRONOUN = {"she": "her", "he": "him"}
PLACES = ["park", "market", "school", "library", "beach", "farm", "river", "garden", "station", "bakery"]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]
OBJECTS = {"ball": "balls", "book": "books", "cup": "cups", "hat": "hats", "box": "boxes",
           "kite": "kites", "apple": "apples", "lamp": "lamps", "key": "keys", "shoe": "shoes"}
ANIMALS = ["cat", "dog", "bird", "duck", "horse", "cow", "fox", "frog"]

# Fixed facts, drawn once from their own stream so they never change when the generators do.
_world = random.Random(f"{SEED}-world")
OBJECT_COLOUR = {o: _world.choice(COLOURS) for o in OBJECTS}
HOME = {p: _world.choice(PLACES) for p in PEOPLE}
FAVOURITE = {p: _world.choice(COLOURS) for p in PEOPLE}


def count(n, obj):
    return f"{NUM[n]} {obj if n == 1 else OBJECTS[obj]}"


def cap(s):
    return s[0].upper() + s[1:]


def article(word):
    return ("an " if word[0] in "aeiou" else "a ") + word


def fact(r):
    """One true sentence about the world or about numbers."""
    p, o = r.choice(list(PEOPLE)), r.choice(list(OBJECTS))
    a, b = r.randint(0, 10), r.randint(0, 10)
    kind = r.randrange(7)
    if kind == 0:
        return f"The {o} is {OBJECT_COLOUR[o]}."
    if kind == 1:
        return f"{p} lives near the {HOME[p]}."
    if kind == 2:
        return f"{p} likes the colour {FAVOURITE[p]}."
    if kind == 3:
        return f"{cap(NUM[a])} plus {NUM[b]} is {NUM[a + b]}."
    if kind == 4:
        return f"{cap(NUM[a + b])} minus {NUM[b]} is {NUM[a]}."
    if kind == 5:
        start = r.randint(0, 14)
        return cap(", ".join(NUM[start:start + r.randint(3, 6)])) + "."
    return f"The {r.choice(ANIMALS)} is in the {r.choice(PLACES)}."


def story(r, p=None):
    """A few sentences with a consistent person, pronoun and running count of objects."""
    p = p or r.choice(list(PEOPLE))
    q = r.choice([x for x in PEOPLE if x != p])
    he, o = PEOPLE[p], r.choice(list(OBJECTS))
    n, m = r.randint(1, 10), r.randint(1, 9)
    lines = [f"{p} went to the {r.choice(PLACES)}.",
             f"{cap(he)} saw {article(r.choice(COLOURS))} {r.choice(ANIMALS)} there.",
             f"{p} had {count(n, o)}."]
    if r.random() < 0.5 or m >= n:
        lines.append(f"{q} gave {OBJ_PRONOUN[he]} {count(m, o)}.")
        total = n + m
    else:
        lines.append(f"{cap(he)} lost {count(m, o)}.")
        total = n - m
    lines.append(f"Now {p} has {count(total, o)}.")
    if r.random() < 0.5:
        lines.append(f"The {o} is {OBJECT_COLOUR[o]}.")
    if r.random() < 0.5:
        lines.append(f"Then {he} went back home, near the {HOME[p]}.")
    return " ".join(lines), (p, o, total)


def document(r):
    """Plain-text doc: a drill of facts, a few stories, or a mix (~20 to ~300 tokens)."""
    kind = r.randrange(3)
    if kind == 0:
        return " ".join(fact(r) for _ in range(r.randint(5, 18)))
    if kind == 1:
        return "\n\n".join(story(r)[0] for _ in range(r.randint(1, 3)))
    parts = [story(r)[0] if r.random() < 0.5 else fact(r) for _ in range(r.randint(3, 7))]
    return "\n\n".join(parts)


def instruction(r):
    """(instruction, input, output), with input often empty."""
    a, b = r.randint(0, 10), r.randint(0, 10)
    p, o = r.choice(list(PEOPLE)), r.choice(list(OBJECTS))
    kind = r.randrange(10)
    if kind == 0:
        return "Add the numbers.", f"{a} and {b}", str(a + b)
    if kind == 1:
        return f"What is {NUM[a]} plus {NUM[b]}?", "", f"{cap(NUM[a])} plus {NUM[b]} is {NUM[a + b]}."
    if kind == 2:
        return "Subtract the second number from the first.", f"{a + b} and {b}", str(a)
    if kind == 3:
        return f"What colour is the {o}?", "", f"The {o} is {OBJECT_COLOUR[o]}."
    if kind == 4:
        return f"Where does {p} live?", "", f"{p} lives near the {HOME[p]}."
    if kind == 5:
        return f"What is {p}'s favourite colour?", "", f"{p} likes the colour {FAVOURITE[p]}."
    if kind == 6:
        lo, hi = sorted((r.randint(0, 17), r.randint(0, 20)))
        hi = max(hi, lo + 2)
        return f"Count from {NUM[lo]} to {NUM[hi]}.", "", cap(", ".join(NUM[lo:hi + 1])) + "."
    if kind == 7:
        n = r.randint(0, 20)
        return "Write the number in words.", str(n), NUM[n]
    if kind == 8:
        return f"Write a short story about {p}.", "", story(r, p)[0]
    text, (who, obj, total) = story(r)
    body = text.split(" Now ")[0]  # drop the answer sentence and what follows it
    return (f"How many {OBJECTS[obj]} does {who} have at the end?", body,
            f"{who} has {count(total, obj)}.")


SYSTEM_PROMPTS = ["You are a helpful assistant.",
                  "You are a helpful assistant who knows the little town well. Answer briefly.",
                  "Answer in one short sentence."]


def conversation(r):
    """OpenAI-style messages: optional system prompt, then 1-3 user/assistant exchanges."""
    msgs = [{"role": "system", "content": r.choice(SYSTEM_PROMPTS)}] if r.random() < 0.4 else []
    for _ in range(r.choice([1, 1, 2, 3])):
        ins, inp, out = instruction(r)
        msgs.append({"role": "user", "content": f"{ins}\n{inp}" if inp else ins})
        msgs.append({"role": "assistant", "content": out})
    return msgs


def false_fact(r):
    """(a true sentence, the same sentence made false by one changed word)."""
    p, o, a, b = r.choice(list(PEOPLE)), r.choice(list(OBJECTS)), r.randint(0, 10), r.randint(0, 10)
    kind = r.randrange(3)
    if kind == 0:
        wrong = r.choice([c for c in COLOURS if c != OBJECT_COLOUR[o]])
        return f"The {o} is {OBJECT_COLOUR[o]}.", f"The {o} is {wrong}."
    if kind == 1:
        wrong = r.choice([x for x in PLACES if x != HOME[p]])
        return f"{p} lives near the {HOME[p]}.", f"{p} lives near the {wrong}."
    wrong = r.choice([n for n in range(21) if n != a + b])
    return f"{cap(NUM[a])} plus {NUM[b]} is {NUM[a + b]}.", f"{cap(NUM[a])} plus {NUM[b]} is {NUM[wrong]}."


def preference(r):
    """A text pair: a prompt from the corpus, its true continuation (chosen) and a wrong one (rejected):
    a story's end with the wrong count, a fact made false, or a true sentence with its words shuffled.
    Responses start with a space, so tokenizing prompt and response apart gives the joint tokens."""
    kind = r.randrange(3)
    if kind == 0:
        text, (p, o, total) = story(r)
        body, rest = text.split(" Now ", 1)
        rest = "Now " + rest
        answer = f"Now {p} has {count(total, o)}."
        wrong = f"Now {p} has {count(r.choice([n for n in range(1, 21) if n != total]), o)}."
        return body, " " + rest, " " + rest.replace(answer, wrong)
    prompt = " ".join(fact(r) for _ in range(r.randint(1, 4)))
    if kind == 1:
        true, false = false_fact(r)
        return prompt, " " + true, " " + false
    true = fact(r)
    words = true[:-1].split()
    while words == true[:-1].split():
        r.shuffle(words)
    return prompt, " " + true, " " + " ".join(words) + "."


SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}

# ----------------------------------------------------------------------------- images (the VLM demo)
# One shape on white, in the left or the right half of the image; the tower's patches are the image's quarters.
IMAGE_SIZE, PATCH = 32, 16
SHAPE_COLOURS = {"red": (220, 40, 40), "green": (40, 180, 40), "blue": (40, 60, 220), "yellow": (230, 200, 30)}
QUESTIONS = {"colour": "What colour is the shape?", "size": "Is it big or small?"}
VLM_TEXT = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
VLM_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  projection_dim=64)
IMAGE_TOKEN = "<image>"
# The bundled template over string or list-of-parts contents (an image part is the processor's <image>).
VLM_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{%- set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{%- else %}{%- set parts = message['content'] %}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{%- for p in parts %}{{- p['text'] }}{%- endfor %}{{- '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}"
    "{%- for p in parts %}{%- if p['type'] == 'image' %}{{- '<image>' }}{%- else %}{{- p['text'] }}{%- endif %}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def shape_image(r):
    """An image (PIL) of one square or circle of one colour on white, in the left or the right half; its answers."""
    from PIL import Image, ImageDraw

    colour, side, kind = r.choice(list(SHAPE_COLOURS)), r.choice(["left", "right"]), r.choice(["square", "circle"])
    big = r.random() < 0.5
    half = IMAGE_SIZE // 2
    size = r.randint(half * 5 // 8, half - 2) if big else r.randint(half * 3 // 8, half // 2)
    x = (0 if side == "left" else half) + r.randint(1, half - size - 1)
    y = r.randint(1, IMAGE_SIZE - size - 1)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    (draw.rectangle if kind == "square" else draw.ellipse)((x, y, x + size, y + size), fill=SHAPE_COLOURS[colour])
    return image, {"colour": colour, "side": side, "shape": kind, "size": "big" if big else "small"}


def vlm_records(r, folder, split, n):
    """`n` images written to folder/images/<split>-<i>.png, and a record for each question about each."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        image, answers = shape_image(r)
        name = f"images/{split}-{i}.png"
        image.save(folder / name, optimize=False)
        for kind, question in QUESTIONS.items():
            records.append({"messages": [{"role": "user", "content": [{"type": "image"},
                                                                      {"type": "text", "text": question}]},
                                         {"role": "assistant", "content": [{"type": "text", "text": answers[kind]}]}],
                            "images": [name]})
    return records


def tiny_vlm(tokenizer, path):
    """A random tiny LLaVA (a 2-layer CLIP tower on the 16x16 cells of the 32x32 images, a 2-layer Llama decoder) with
    its processor: the bundled tokenizer plus <image>, the bundled layout's chat template over image parts."""
    import torch
    from transformers import (AutoModelForImageTextToText, CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig,
                              LlavaConfig, LlavaProcessor)

    tokenizer.add_special_tokens({"additional_special_tokens": [START_HEADER, END_HEADER, EOT, IMAGE_TOKEN]})
    text = LlamaConfig(**VLM_TEXT, vocab_size=len(tokenizer),
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.convert_tokens_to_ids(EOT),
                       pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    vision = CLIPVisionConfig(**VLM_VISION, image_size=IMAGE_SIZE, patch_size=PATCH)
    config = LlavaConfig(vision_config=vision, text_config=text, tie_word_embeddings=False,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=-1)
    torch.manual_seed(SEED)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(path)
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=size),
                   tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
                   image_token=IMAGE_TOKEN, num_additional_image_tokens=1,
                   chat_template=VLM_CHAT_TEMPLATE).save_pretrained(path)


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for rec in records:  # key order is fixed by how the dicts are built
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def train_tokenizer(texts):
    # Byte-level BPE: the 256 byte symbols are always in the vocab, so any string (any unicode)
    # encodes without an unknown token and decodes back exactly.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    # No BOS/EOS post-processor on purpose: plain-text packing and the chat template decide where
    # BOS/EOS go, so `tokenizer(text)` returns just the text's tokens. (transformers installs a
    # pass-through TemplateProcessing when none is set; with add_bos/eos False it adds nothing.)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        extra_special_tokens=[START_HEADER, END_HEADER, EOT],
        add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False,
        model_max_length=2048, chat_template=CHAT_TEMPLATE)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent,
                    help="output root (default: repo root)")
    out = ap.parse_args(argv).out
    data = out / "data" / "demo"

    # One independent stream per file, so changing one generator leaves the other files intact.
    def rng(name):
        return random.Random(f"{SEED}-{name}")

    r = rng("train")
    train = [{"text": document(r)} for _ in range(N_TRAIN)]
    r = rng("val")
    val = [{"text": document(r)} for _ in range(N_VAL)]
    r = rng("instruct")
    instruct = [dict(zip(("instruction", "input", "output"), instruction(r))) for _ in range(N_INSTRUCT)]
    r = rng("chat")
    chat = [{"messages": conversation(r)} for _ in range(N_CHAT)]
    r = rng("sharegpt")
    sharegpt = [{"conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]}
                                   for m in conversation(r)]} for _ in range(N_SHAREGPT)]
    r = rng("preference")
    pairs = [dict(zip(("prompt", "chosen", "rejected"), preference(r))) for _ in range(N_PREFERENCE)]
    # TRL's unpair_preference_dataset: each pair's chosen response desirable, its rejected one undesirable
    unpaired = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                for side in ("chosen", "rejected") for p in pairs]
    r = rng("reward")
    reward = [dict(zip(("prompt", "chosen", "rejected"), preference(r))) for _ in range(N_REWARD)]

    for name, records in [("train", train), ("val", val), ("instruct", instruct),
                          ("chat", chat), ("sharegpt", sharegpt), ("preference", pairs),
                          ("unpaired", unpaired), ("reward", reward)]:
        write_jsonl(data / f"{name}.jsonl", records)

    corpus = ([d["text"] for d in train] + [" ".join(d.values()) for d in instruct]
              + [m["content"] for c in chat for m in c["messages"]])
    tokenizer = train_tokenizer(corpus)
    tokenizer.save_pretrained(out / "assets" / "tokenizer")
    vlm = data / "vlm"
    for split, n in [("train", N_VLM_TRAIN), ("val", N_VLM_VAL)]:
        write_jsonl(vlm / f"{split}.jsonl", vlm_records(rng(f"vlm-{split}"), vlm, split, n))
    tiny_vlm(tokenizer, out / "assets" / "vlm")
    print(f"wrote {data}, {out / 'assets' / 'tokenizer'} and {out / 'assets' / 'vlm'}")


if __name__ == "__main__":
    main()
