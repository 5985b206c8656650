"""README.md and docs/ stay honest: every recipe, config, bench file, `python -m llmtrain.X` module and
`make` target and config key they name exists, every relative link (and its #anchor) resolves, and the
README stays a quick start. No training runs: the recipes are only asked for --help-config."""

from __future__ import annotations

import importlib
import importlib.util
import re

import pytest

from helpers import REPO, recipe_configs
from llmtrain.config import describe

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
README_MAX_LINES = 260
# Added by the lint / fast-test change in flight; drop once the Makefile has them.
PENDING_MAKE_TARGETS = {"lint", "test-fast"}

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]+`")
PATHS = re.compile(r"(?<![\w/.-])((?:recipes/[\w./-]+?\.py|configs/[\w./-]+?\.yaml)|bench/[\w./-]*)")
MODULE = re.compile(r"-m\s+(llmtrain(?:\.\w+)+)")
MAKE = re.compile(r"(?<![\w-])make\s+(?:[A-Z_]+=\S*\s+)*([a-z][\w-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
SECTIONS = "model|tokenizer|data|parallel|distributed|train|eval|checkpoint|log|lora|dpo"
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
