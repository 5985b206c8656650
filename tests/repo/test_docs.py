"""README.md and docs/ stay honest: every recipe, config, bench file, `python -m llmtrain.X` module and
`make` target and config key they name exists, every relative link (and its #anchor) resolves, and the
README stays a quick start. No training runs: the recipes are only asked for --help-config."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex

import pytest

from helpers import REPO, recipe_configs
from llmtrain.config import describe, load_config
from llmtrain.data.__main__ import config_class
from llmtrain.export import LORA_OUTPUTS

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
README_MAX_LINES = 260
# Added by the lint / fast-test change in flight; drop once the Makefile has them.
PENDING_MAKE_TARGETS = {"lint", "test-fast"}

FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.MULTILINE | re.DOTALL)  # indented too (inside a list item)
INLINE_CODE = re.compile(r"`[^`\n]+`")
PATHS = re.compile(r"(?<![\w/.-])((?:recipes/[\w./-]+?\.py|configs/[\w./-]+?\.yaml)|bench/[\w./-]*)")
MODULE = re.compile(r"-m\s+(llmtrain(?:\.\w+)+)")
MAKE = re.compile(r"(?<![\w-])make\s+(?:[A-Z_]+=\S*\s+)*([a-z][\w-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
SECTIONS = "model|tokenizer|data|parallel|distributed|train|eval|checkpoint|log|lora|dpo|distill"
# A config key as written in the docs: a whole code span (`lora.r`, `train.lr=1e-4`, `dpo.beta: 0.1`) or an
# override on a command line; `parallel.*` and file names (`model.safetensors`) are not keys.
CONFIG_SPAN = re.compile(rf"^((?:{SECTIONS})(?:\.[a-z_][a-z0-9_]*)+)(?:=\S*|: .*)?$")
CONFIG_OVERRIDE = re.compile(rf"(?<!\S)((?:{SECTIONS})(?:\.[a-z_][a-z0-9_]*)+)=")
FILE_SUFFIXES = {"safetensors", "json", "jsonl", "yaml", "py", "txt", "csv", "parquet"}
MISSPELT_ON_PURPOSE = {"train.lrr"}  # the example of the unknown-key error


def rel(path):
    return path.relative_to(REPO).as_posix()


def text(path):
    return path.read_text(encoding="utf-8")


def code(md):
    """Fenced blocks and inline code spans: where commands are written."""
    fences = FENCE.findall(md)
    return "\n".join(fences + INLINE_CODE.findall(FENCE.sub("", md)))


def prose(md):
    """The text outside code, where links are."""
    return INLINE_CODE.sub("", FENCE.sub("", md))


def anchors(md):
    """GitHub's heading ids: lower case, punctuation but '-' and '_' dropped, spaces to '-', '-N' on repeats."""
    seen, out = {}, set()
    for heading in HEADING.findall(FENCE.sub("", md)):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def makefile_targets():
    return set(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", text(REPO / "Makefile"), re.MULTILINE))


@pytest.fixture(scope="module")
def config_keys():
    """Every key any recipe accepts, as each recipe's --help-config lists them (config.describe of its class),
    and the sections holding them (eval.harness)."""
    leaves = {key.replace("[]", "") for cls in recipe_configs() for key, *_ in describe(cls)}
    keys = leaves | {leaf.rsplit(".", n)[0] for leaf in leaves for n in range(1, leaf.count("."))}  # sections
    assert {"train.lr", "dpo.beta", "lora.r"} <= keys, sorted(keys)
    return keys


def named_config_keys(md):
    spans = [span.strip("`") for span in INLINE_CODE.findall(md)]
    named = {m.group(1) for span in spans if (m := CONFIG_SPAN.match(span))}
    named |= set(CONFIG_OVERRIDE.findall("\n".join(FENCE.findall(md))))
    return {k for k in named if k.rsplit(".", 1)[1] not in FILE_SUFFIXES} - MISSPELT_ON_PURPOSE


@pytest.fixture(scope="module", params=DOCS, ids=rel)
def doc(request):
    assert request.param.is_file(), f"{rel(request.param)} is missing"
    return request.param


def test_named_files_exist(doc):
    named = {m.rstrip(".,:;") for m in PATHS.findall(text(doc))}
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{rel(doc)} names files that do not exist: {missing}"


def test_named_modules_run_with_python_m(doc):
    bad = []
    for name in sorted(set(MODULE.findall(text(doc)))):
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            bad.append(f"{name}: {e}")
            continue
        # A package runs under `python -m` only through its __main__.
        if hasattr(module, "__path__") and importlib.util.find_spec(f"{name}.__main__") is None:
            bad.append(f"{name}: a package without __main__")
    assert not bad, f"{rel(doc)} names modules `python -m` cannot run: {bad}"


def test_named_make_targets_exist(doc):
    known = makefile_targets() | PENDING_MAKE_TARGETS
    unknown = sorted(set(MAKE.findall(code(text(doc)))) - known)
    assert not unknown, f"{rel(doc)} names make targets the Makefile lacks: {unknown}"


def test_named_config_keys_exist(doc, config_keys):
    def known(key):  # a key inside a dict-valued one (model.config.hidden_size) counts as its parent's
        parts = key.split(".")
        return any(".".join(parts[:n]) in config_keys for n in range(2, len(parts) + 1))
    unknown = sorted(k for k in named_config_keys(text(doc)) if not known(k))
    assert not unknown, f"{rel(doc)} names config keys no recipe's --help-config lists: {unknown}"


def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(prose(text(doc))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(text(dest)):
            broken.append(f"{target}: no heading with id '{anchor}' in {rel(dest)}")
    assert not broken, f"{rel(doc)} has broken links: {broken}"


def test_readme_is_a_quick_start():
    lines = text(REPO / "README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"


def test_the_checks_see_what_they_check():
    # The patterns above must find the README's commands, or every check would pass on nothing.
    readme = text(REPO / "README.md")
    assert {"demo", "test"} <= set(MAKE.findall(code(readme)))
    assert "recipes/finetune.py" in PATHS.findall(readme) and "configs/demo.yaml" in PATHS.findall(readme)
    assert "llmtrain.tools.generate" in MODULE.findall(readme)
    assert {"parallel.mixed_precision", "lora.enabled", "model.path", "train.max_steps"} <= named_config_keys(readme)
    assert "docs/data.md" in LINK.findall(prose(readme))
    assert "checkpoints-resume-preemption-and-export-checkpoint" in anchors(text(REPO / "docs" / "checkpoints.md"))


# -- every fenced command's paths exist after the documented steps before it -------------------------
# A reader runs README.md's commands, then each page's in the order README's Docs table lists them. A path a
# command reads (a --config, a --model, a checkpoint, an export, a repo file) must be in the repository or
# written by a command before it; what each command writes is derived from what it runs (a recipe run: its
# config's output_dir, checkpoints and exports; convert: OUT; eval --output; plot's curves.png ...).

# A path from the repository root; a placeholder (configs/X.yaml, step_<N>) is no path.
ROOTED = re.compile(r"^(?:outputs|configs|data|assets|recipes|slurm|bench|scripts|docs|tests|logs)/"
                    r"(?![\w./-]*(?:\b[A-Z]\b|<))[\w./-]*$")
READS = {"--config", "--config_file", "--model", "--base", "--tasks", "--compare", "--logdir"}  # flags' values
WRITES = {"--output", "--out", "--output-dir", "--log-dir"}
SWITCHES = {"--standalone", "--chat", "--json", "--overwrite", "--help", "--help-config", "--print-config"}
CONFIG_PATHS = ("model.path", "tokenizer.path", "data.path", "checkpoint.resume")  # read from earlier runs


def reading_order():
    """README.md, then the pages of its Docs table in that order, then any page it does not list."""
    listed = [REPO / target for target in re.findall(r"^\| \[[^\]]+\]\(([^)]+\.md)\)", text(REPO / "README.md"),
                                                         re.MULTILINE)]
    return [REPO / "README.md", *listed, *(d for d in DOCS if d not in listed and d != REPO / "README.md")]


def fenced_commands(path):
    """(line number, argv) of each shell command in the page's bash fences (continuations joined, comments cut),
    and (line number, [quoted outputs/... strings]) of each python fence line."""
    out, fence, pending, start = [], None, "", 0
    for number, line in enumerate(text(path).splitlines(), 1):
        line = line.strip()  # a fence inside a list item is indented
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            continue
        if fence == "python":
            out += [(number, ["<python>", *re.findall(r"[\"'](outputs/[^\"']+)[\"']", line)])]
        if fence != "bash":
            continue
        start = start if pending else number
        pending += line.rstrip("\\") + " "
        if not line.endswith("\\"):
            argv = shlex.split(pending, comments=True)
            pending = ""
            if argv:
                out.append((start, argv))
    return out


class Made:
    """What the commands so far wrote: exact paths (a run's output_dir and its files), directories whose whole
    content counts as written (exports, checkpoints, convert's OUT, ...), and each checkpoint's run config."""

    def __init__(self):
        self.exact, self.trees, self.checkpoints = set(), set(), {}

    def has(self, path: str) -> bool:
        path = path.rstrip("/")
        return (REPO / path).exists() or path in self.exact | self.trees or \
            any(path.startswith(f"{tree}/") for tree in self.trees)


def overrides_of(args):
    return [a for a in args if re.match(r"^[a-z_]+(\.[a-z_]+)*=", a)]


def resolved(args, cls_of):
    """The config a command's `--config C [overrides]` resolves to, or None (no --config, or a help request)."""
    if "--config" not in args or {"--help", "--help-config"} & set(args):
        return None
    config = args[args.index("--config") + 1]
    if not (REPO / config).is_file():
        return None  # a read: reported missing on its own
    overrides = overrides_of(args[args.index("--config") + 2:])
    return load_config(REPO / config, overrides, cls_of(config, overrides))


def run_writes(cfg, made):
    """A recipe run's writes, from its resolved config: output_dir, its exports and the checkpoints it keeps."""
    out, ck, last = cfg.output_dir, cfg.checkpoint, cfg.train.max_steps
    made.exact |= {out, f"{out}/config.yaml", f"{out}/metrics.jsonl"}
    made.trees |= {f"{out}/{d}" for d in (LORA_OUTPUTS[cfg.lora.export] if cfg.lora.enabled else ("hf",))}
    steps = [s for s in range(1, last + 1) if ck.every_steps and (s % ck.every_steps == 0 or s == last)]
    for step in steps[-ck.keep_last:] if ck.keep_last else steps:
        made.trees.add(f"{out}/checkpoints/step_{step}")
        made.checkpoints[f"{out}/checkpoints/step_{step}"] = cfg
    made.trees |= {f"{out}/hf/step_{s}" for s in range(1, last + 1)
                   if ck.export_every_steps and s % ck.export_every_steps == 0}
    made.trees |= {f"{out}/tensorboard"} if cfg.log.tensorboard else set()
    made.trees |= {f"{out}/wandb"} if cfg.log.wandb.project else set()


def step(argv, made, cls_of) -> list[str]:
    """Runs one command on `made` (adds what it writes); returns the paths it reads."""
    if argv[0] == "<python>":
        return argv[1:]
    if argv[:2] == ["make", "demo"]:  # the Makefile's demo target is this run
        demo = re.search(r"^demo:.*\n\t\S*torchrun (.+)$", text(REPO / "Makefile"), re.MULTILINE).group(1)
        return step(["torchrun", *shlex.split(demo)], made, cls_of)
    if argv[:2] == ["mkdir", "-p"]:
        made.trees |= set(argv[2:])
        return []
    module = argv[argv.index("-m") + 1] if "-m" in argv else None
    reads, positional, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        if arg in READS | WRITES:  # a flag and its value (--compare: its two)
            n = 2 if arg == "--compare" else 1
            values, i = argv[i + 1:i + 1 + n], i + n
            if arg in READS:
                reads += values
            else:
                made.trees |= set(values)
        elif eq and key != "output_dir" and ROOTED.match(value):
            reads.append(value)  # LLMTRAIN_RECIPE=recipes/dpo.py, data.path=data/...
        elif arg.startswith("-") and not eq and arg not in SWITCHES and arg != "-m":
            i += 1  # another flag's value (--dtype bf16)
        elif not arg.startswith("-") and arg != module:
            positional.append(arg)
        i += 1
    help_only = {"--help", "--help-config", "--print-config"} & set(argv)
    cfg = resolved(argv, cls_of)
    if cfg is not None:  # what its config reads from earlier runs
        paths = [getattr(getattr(cfg, p.split(".")[0]), p.split(".")[1]) for p in CONFIG_PATHS]
        reads += [p for p in paths + [cfg.model.path if cfg.tokenizer.path is None else None]
                  if isinstance(p, str) and p.startswith("outputs/")]
        if any(p.startswith("recipes/") for p in positional) and not help_only:
            run_writes(cfg, made)
    if module == "llmtrain.convert" and not help_only:
        ckpt, out = positional[-2:]
        run = made.checkpoints.get(ckpt)
        made.trees |= {out} if run is None or not run.lora.enabled else \
            {f"{out}/{d}" for d in LORA_OUTPUTS[run.lora.export]}
        return reads + [ckpt]
    if module == "llmtrain.plot" and not help_only:
        made.exact.add(f"{positional[-1].rstrip('/')}/curves.png")
        reads.append(f"{positional[-1].rstrip('/')}/metrics.jsonl")
    return reads + [p for p in positional if ROOTED.match(p)]


def cls_of(config, overrides):
    """The config class of the recipe whose sections the file sets (as `python -m llmtrain.data` finds it)."""
    return config_class(str(REPO / config), overrides)


def test_every_fenced_command_reads_only_what_the_steps_before_it_make():
    made, bad = Made(), []
    for doc in reading_order():
        for number, argv in fenced_commands(doc):
            bad += [f"{rel(doc)}:{number}: {path}" for path in step(argv, made, cls_of) if not made.has(path)]
    assert not bad, "fenced commands read paths that no step before them makes:\n" + "\n".join(bad)


def test_the_command_check_derives_what_each_step_writes_and_reads():
    made = Made()
    demo = "torchrun --standalone --nproc_per_node=2 recipes/finetune.py --config configs/demo.yaml"
    assert set(step(shlex.split(demo), made, cls_of)) == {"recipes/finetune.py", "configs/demo.yaml"}
    assert made.has("outputs/demo/hf/model.safetensors") and made.has("outputs/demo/metrics.jsonl")
    assert not made.has("outputs/demo/checkpoints/step_150") and not made.has("outputs/demo/adapter")
    step(shlex.split(f"{demo} checkpoint.every_steps=40 output_dir=outputs/c"), made, cls_of)
    assert [made.has(f"outputs/c/checkpoints/step_{s}") for s in (40, 80, 120, 150)] == [False, False, True, True]
    lora = shlex.split(demo.replace("demo.yaml", "demo-lora.yaml") + " checkpoint.every_steps=100")
    assert "outputs/demo/hf" in step(lora, made, cls_of)  # model.path: the SFT demo's export
    assert made.has("outputs/demo-lora/adapter") and made.has("outputs/demo-lora/hf")
    convert = "python -m llmtrain.convert outputs/demo-lora/checkpoints/step_100 outputs/x --dtype bf16"
    assert step(shlex.split(convert), made, cls_of) == ["outputs/demo-lora/checkpoints/step_100"]
    assert made.has("outputs/x/adapter/adapter_config.json") and not made.has("outputs/x/model.safetensors")
    data = "python -m llmtrain.data --config configs/demo-grpo.yaml --n 1"
    assert set(step(shlex.split(data), made, cls_of)) == {"configs/demo-grpo.yaml", "outputs/demo/hf"}
    assert step(["<python>", "outputs/nowhere"], made, cls_of) == ["outputs/nowhere"]
    (number, argv), *_ = fenced_commands(REPO / "README.md")  # the line numbers a failure names are the file's
    assert argv == ["make", "demo"] and text(REPO / "README.md").splitlines()[number - 1].startswith("make demo")


def test_lists_of_configs_and_benchmarks_are_whole():
    """models.md's table names every config; bench/README.md counts the benchmarks bench/run.py runs and its
    --only list names each."""
    table = set(re.findall(r"^\| `(configs/[^`]+\.yaml)` \|", text(REPO / "docs" / "models.md"), re.MULTILINE))
    assert table == {rel(p) for p in (REPO / "configs").glob("*.yaml")}
    names = re.search(r"^NAMES = \[(.+?)\]$", text(REPO / "bench" / "run.py"), re.MULTILINE | re.DOTALL).group(1)
    names = re.findall(r'"(\w+)"', names)
    bench = " ".join(text(REPO / "bench" / "README.md").split())
    count = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
             "twelve", "thirteen", "fourteen", "fifteen"][len(names)]
    assert f"`python bench/run.py` runs {count} benchmarks" in bench
    assert f"`--only {' '.join(names)}`" in bench


def test_the_first_sentence_names_every_recipe():
    first = " ".join(text(REPO / "README.md").split("\n\n")[1].split()).split(". ")[0]
    assert all(name in first for name in ("supervised fine-tuning", "LoRA", "DPO", "GRPO", "distillation")), first


def test_curve_figures_are_what_the_script_prints():
    """scripts/curve_figures.py makes the demo figures docs/grpo.md quotes: window means, the
    first and last windows with their ends; a resumed run's repeated step counts once, its last record."""
    spec = importlib.util.spec_from_file_location("curve_figures", REPO / "scripts" / "curve_figures.py")
    curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curve)
    records = [{"step": s, "reward": s / 100} for s in range(1, 121)] + [{"step": 120, "reward": 0.0}]
    assert curve.figures(records, "reward", 50, 10) == (
        "`reward`, mean over 50-step windows: **0.255** (steps 1-50; 0.055 over steps 1-10), 0.755, "
        "**1.045** (steps 101-120; 1.035 over 111-120)")
    doc = " ".join(text(REPO / "docs" / "grpo.md").split())
    assert "python scripts/curve_figures.py outputs/demo-grpo" in doc
    # The line docs/grpo.md quotes is what the script prints from the committed run it names.
    measured = [json.loads(line) for line in text(REPO / "docs" / "measured" / "demo-grpo.jsonl").splitlines()]
    assert "measured/demo-grpo.jsonl" in doc and curve.figures(measured, "reward", 50, 10) in doc
    assert re.search(r"`reward`, mean over 50-step windows: \*\*[\d.]+\*\* \(steps 1-50; [\d.]+ over steps 1-10\)"
                     r"(, [\d.]+)+, \*\*[\d.]+\*\* \(steps 351-400; [\d.]+ over 391-400\)", doc)


def commands(md):
    """(the comment lines above it, the command) for every command line of the fenced blocks, continuations joined."""
    for fence in FENCE.findall(md):
        comments = []
        for line in fence.split("\n", 1)[1].rsplit("\n", 1)[0].replace("\\\n", " ").splitlines():
            if line.lstrip().startswith("#"):
                comments.append(line)
            elif line.strip():
                yield " ".join(comments), " ".join(line.split("#")[0].split())
                comments = []


def test_commands_that_train_a_demo_config_leave_its_outputs_to_it():
    """The pages after a demo read what it wrote (outputs/demo/hf, outputs/demo-lora/adapter, ...): every other
    command that trains a configs/demo*.yaml (with overrides: another run) names its own output_dir (a demo keeps
    no checkpoint, so in the demo's it would train over again there, replacing the export the pages read), and a
    command with placeholders (N processes, [key.sub=value ...]) is marked as a template."""
    for path in DOCS:
        for comment, cmd in commands(text(path)):
            demo = re.search(r"recipes/\S+\.py --config configs/demo[\w-]*\.yaml", cmd)
            if not demo or "--print-config" in cmd or any(key in cmd for key in MISSPELT_ON_PURPOSE):
                continue
            if re.search(r"=N\b|\[key", cmd):
                assert "template" in comment, (rel(path), cmd)
            else:
                assert cmd.endswith(demo[0]) or "output_dir=" in cmd, (rel(path), cmd)
