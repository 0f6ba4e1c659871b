"""The documentation site (docs/, mkdocs.yml) and the README landing page: nothing of the former single-page README
lost, every page reachable, every API reference pointing at a module that exists. Fast and offline: no mkdocs
needed (CI builds the site with `make docs`, --strict); where mkdocs is installed, one slow test builds it too."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "hf_ppo"

# Every `## ` / `### ` section title of the README before it became a landing page (`git show 3a18292:README.md`),
# and the docs page that holds it now, as a heading of the same text.
OLD_README_SECTIONS = {
    "Quick start": "getting-started/quickstart.md",
    "Coming from TRL": "guides/from-trl.md",
    "TRL 1.12 `PPOTrainer`": "guides/from-trl.md",
    "TRL 0.11 `PPOTrainer.step()`": "guides/from-trl.md",
    "Names: TRL -> hf_ppo": "guides/from-trl.md",
    "Deliberately different": "guides/from-trl.md",
    "The demo: `make demo`": "getting-started/demo.md",
    "The recipe: `recipes/ppo.py` (`hf-ppo train`)": "getting-started/command.md",
    "More than one GPU": "guides/multi-gpu.md",
    "Sharding the policy: FSDP2": "guides/multi-gpu.md",
    "Batch sizes, iterations and steps": "concepts/batch-sizes.md",
    "What one iteration does": "concepts/iteration.md",
    "Loss variants": "concepts/iteration.md",
    "Advantage estimators and samples per prompt": "concepts/estimators.md",
    "Environments: multi-turn conversations and tool calls": "guides/environments.md",
    "Choosing a critic": "concepts/critics.md",
    "Which configuration to pick: the learning table": "concepts/critics.md",
    "Models": "guides/models.md",
    "Architectures tested": "guides/models.md",
    "A real model: SmolLM2-135M-Instruct, and GGUF checkpoints": "guides/models.md",
    "Pad token": "guides/models.md",
    "Stop tokens": "guides/models.md",
    "Dropout": "guides/models.md",
    "Value head": "guides/models.md",
    "Quantization, reference, loading": "guides/models.md",
    "Reward models and their inputs": "concepts/rewards.md",
    "Mixed rewards": "concepts/rewards.md",
    "Continuing from an SFT adapter": "guides/models.md",
    "Metrics": "reference/metrics.md",
    "Did it work? The policy against its reference": "guides/evaluation.md",
    "`hf-ppo evaluate`: a saved policy against its start": "guides/evaluation.md",
    "Watching for collapse and reward hacking": "guides/evaluation.md",
    "Saving, checkpoints and resume": "guides/checkpoints.md",
    "Warnings and the console": "guides/errors.md",
    "Reliability": "guides/checkpoints.md",
    "Publishing to the Hub": "guides/hub.md",
    "Benchmarks: `make bench`": "project/benchmarks.md",
    "Errors at construction": "guides/errors.md",
    "Extending hf_ppo: a rollout engine or a critic": "guides/extending.md",
    "Testing": "project/testing.md",
    "Tested versions": "getting-started/installation.md",
    "Layout": "project/architecture.md",
}

README_MAX_LINES = 400


def headings(text: str) -> list[str]:
    """The Markdown headings of a page (any level), outside fenced code blocks."""
    found, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (match := re.match(r"^#{1,6}\s+(.*?)\s*$", line)):
            found.append(match[1])
    return found


def nav_pages(nav) -> list[str]:
    """The page paths of mkdocs.yml's nav, in order (a nav entry is a path, {title: path} or {title: [entries]})."""
    pages = []
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return [p for p in pages if not re.match(r"^[a-z]+://", p)]


def mkdocs_config() -> dict:
    class Loader(yaml.SafeLoader):  # mkdocs.yml may use !ENV / !!python tags: read them as plain values
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def docs_pages() -> list[str]:
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


@pytest.mark.parametrize("title", sorted(OLD_README_SECTIONS))
def test_every_old_readme_section_is_a_heading_of_its_docs_page(title):
    page = DOCS / OLD_README_SECTIONS[title]
    assert page.is_file(), f"{page.relative_to(ROOT)} (home of the README section {title!r}) is missing"
    assert title in headings(page.read_text()), (
        f"the README section {title!r} has no heading of that text in {page.relative_to(ROOT)}: keep the section "
        "(and its heading) when editing the page, or move both and update OLD_README_SECTIONS")


def test_the_readme_is_a_landing_page_that_opens_with_make_demo_and_make_test():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, (
        f"README.md has {len(text.splitlines())} lines (at most {README_MAX_LINES}): move sections to docs/")
    block = re.search(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S)
    assert block, "README.md has no code block"
    commands = [line.split("#")[0].strip() for line in block[1].splitlines() if line.split("#")[0].strip()]
    assert commands[:2] == ["make demo", "make test"], f"README.md's first commands are {commands[:2]}"


def test_the_readme_links_into_docs_pages_that_exist():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((docs/[^)#\s]*)(?:#[^)]*)?\)", text)
    assert targets, "README.md links to no docs page"
    missing = sorted({t for t in targets if not (ROOT / t).exists()})
    assert not missing, f"README.md links to missing docs files: {missing}"


def test_every_nav_page_exists_and_every_docs_page_is_in_the_nav():
    nav = nav_pages(mkdocs_config()["nav"])
    missing = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"
    assert len(nav) == len(set(nav)), "a page appears twice in mkdocs.yml's nav"
    orphans = sorted(set(docs_pages()) - set(nav))
    assert not orphans, f"docs pages missing from mkdocs.yml's nav: {orphans}"


def test_every_api_reference_names_a_module_that_exists():
    references = []
    for page in docs_pages():
        for line in (DOCS / page).read_text().splitlines():
            if match := re.match(r"^:::\s*(\S+)", line):
                references.append((page, match[1]))
    assert references, "no ::: reference in docs/"
    wrong = []
    for page, identifier in references:
        path = ROOT / identifier.replace(".", "/")
        if not (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()):
            wrong.append(f"docs/{page}: ::: {identifier}")
    assert not wrong, "::: references to modules that do not exist:\n" + "\n".join(wrong)


def test_each_package_has_a_reference_page_with_every_module():
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert packages, "hf_ppo/ has no sub-package"
    nav = set(nav_pages(mkdocs_config()["nav"]))
    problems = []
    for package in packages:
        page = DOCS / "reference" / f"{package}.md"
        if f"reference/{package}.md" not in nav or not page.is_file():
            problems.append(f"docs/reference/{package}.md is missing (or not in the nav)")
            continue
        text = page.read_text()
        for module in sorted((PACKAGE / package).glob("*.py")):
            if module.name != "__init__.py" and not re.search(rf"^:::\s*hf_ppo\.{package}\.{module.stem}\s*$", text,
                                                              re.M):
                problems.append(f"docs/reference/{package}.md has no `::: hf_ppo.{package}.{module.stem}`")
    assert not problems, "\n".join(problems)


def test_every_hf_ppo_path_the_docs_name_exists():
    named = set()
    for page in [*docs_pages(), "../README.md"]:
        named |= {(page, p) for p in re.findall(r"`(hf_ppo/[\w/.-]+)`", (DOCS / page).read_text())}
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path.rstrip("/")).exists())
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_the_ppo_config_page_is_generated_from_the_dataclass():
    """docs/hooks.py replaces the marker with one table per `# ---- Section ----` of PPOConfig's source: every PPO
    field appears, with its help."""
    assert "<!-- hf_ppo:ppo-config -->" in (DOCS / "reference" / "config.md").read_text()
    import dataclasses

    from transformers import TrainingArguments

    from hf_ppo import PPOConfig

    hooks = _hooks()
    page = hooks.ppo_config_markdown()
    own = {f.name for f in dataclasses.fields(PPOConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    missing = sorted(name for name in own if f"| `{name}` |" not in page)
    assert not missing, f"PPOConfig fields missing from the generated page: {missing}"
    assert page.count("\n## ") + page.startswith("## ") >= 5, "the PPOConfig page lost its sections"


def _hooks():
    sys.path.insert(0, str(DOCS))
    try:
        import hooks
    finally:
        sys.path.remove(str(DOCS))
    return hooks


def test_the_architecture_layout_is_generated_from_the_package():
    """docs/hooks.py replaces the layout marker with a tree of hf_ppo/ read from the files: every module and every
    sub-package is in it (at its place in the tree), each module with its docstring's summary; the page keeps no
    hand-written copy that could drift."""
    page = (DOCS / "project" / "architecture.md").read_text()
    assert "<!-- hf_ppo:layout -->" in page
    assert "\nhf_ppo/\n" not in page, "a hand-written layout block is left in docs/project/architecture.md"
    hooks = _hooks()
    block = hooks.layout_markdown()
    assert block.startswith("```\nhf_ppo/\n") and block.endswith("\n```")
    lines = block.splitlines()[1:-1]
    # An entry starts at two spaces a level of the tree; a description's continuation line starts further right.
    listed, described, stack = set(), {}, []
    for line in lines:
        indent = len(line) - len(line.lstrip())
        name = line.strip().split(None, 1)[0]
        if indent % 2 or indent // 2 > len(stack) or not name.endswith(("/", ".py")):
            continue
        stack = stack[:indent // 2] + [name.rstrip("/")]
        path = "/".join(stack)
        listed.add(path)
        described[path] = line.strip()[len(name):].strip()
    modules = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")
               if "__pycache__" not in p.parts and not (p.name == "__init__.py" and p.parent != PACKAGE)}
    packages = {p.parent.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    missing = sorted((modules | packages) - listed)
    assert not missing, f"modules or packages missing from the generated layout: {missing}"
    folders = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*") if p.is_dir()}
    assert not sorted(listed - modules - folders - {"hf_ppo"}), "the layout names what is not there"
    assert all(described[m] for m in modules), "a module listed without its docstring's summary"
    assert all(described[p].startswith("floor ") for p in packages), "a sub-package listed without its floor"
    assert "hf_ppo/runtime/ranges.py" in listed  # the module the hand-written block had left out


def test_the_layout_summary_is_a_docstrings_first_sentence():
    hooks = _hooks()
    assert hooks.summary("`warn_user`: the one way hf_ppo warns. More here.\n\nAnd here.") == \
        "warn_user: the one way hf_ppo warns"
    assert hooks.summary("Rewards (e.g. `exact_answer`) checked.\nSecond line. Third.") == \
        "Rewards (e.g. exact_answer) checked"
    long = "Loading the models and their tokenizers: " + "a long story, " * 20 + "end."
    assert hooks.summary(long) == "Loading the models and their tokenizers"
    assert hooks.summary("Models: " + "a long story, " * 20 + "end.") == ("Models: " + "a long story, " * 20 + "end")


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs / mkdocstrings not installed (the docs extra): expected on CI's floor leg and before "
                    "`make docs`, which builds the site strict in CI")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def test_the_docs_say_what_a_first_verifiable_run_needs():
    """Issue 50: the README's "accuracy_reward runs unchanged" said nothing of its `solution` column and `\\boxed{}`
    answers; a local held-out file was documented in --help alone; the guide did not say that a verifiable reward
    usually needs a format reward or a few-shot prompt at first, nor which reward the SmolLM2 table used."""
    readme = (ROOT / "README.md").read_text()
    bullet = readme[readme.index("trl.rewards.accuracy_reward"):][:400]
    assert "`solution`" in bullet and "\\boxed{" in bullet and "math-verify" in bullet
    command = (DOCS / "getting-started" / "command.md").read_text()
    assert "dataset_test_split: test.jsonl" in command and "max_completion_length" in command
    guide = (DOCS / "guides" / "verifiable-rewards.md").read_text()
    assert "format reward" in guide and "few-shot" in guide and "answer_score" in guide
    assert "frac_reward_zero_std" in (DOCS / "reference" / "metrics.md").read_text()
    assert "NoSignalWarning" in (DOCS / "guides" / "errors.md").read_text()
