"""MkDocs hook (`hooks:` in mkdocs.yml): pages generated from the code at build time, so they cannot drift from it.

`<!-- hf_ppo:ppo-config -->` in a page becomes the `PPOConfig` reference: one table per section of the class body
(the `# ---- Section name ----` comment lines of the source file), each field with its type, default and help, read
from `dataclasses.fields(PPOConfig)`. The source file is found with `inspect.getsourcefile(PPOConfig)`, so the hook
follows the class wherever it lives. A field added to `PPOConfig` appears here at the next build, and a section
comment that no longer matches any field fails the build.

A docs page named inside a section comment (`(docs/concepts/critics.md)`) becomes a link to that page.

`<!-- hf_ppo:layout -->` becomes the package's layout (`layout_markdown`): a fenced tree of hf_ppo/ read from the
checkout's files, every sub-package with the floor its `__init__.py` docstring opens with ("Floor 3, ..."), every
module with the first sentence of its docstring, every data folder with its files. Nothing is imported. A module
added, moved or removed changes the page at the next build; a module without a docstring, or a sub-package whose
docstring names no floor, fails the build.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

try:  # the tables build without mkdocs too (tests/project/test_docs.py checks them in the test leg, where it is absent)
    from mkdocs.exceptions import PluginError
except ImportError:  # pragma: no cover - mkdocs present in `make docs`
    PluginError = RuntimeError

PPO_CONFIG_MARKER = "<!-- hf_ppo:ppo-config -->"
LAYOUT_MARKER = "<!-- hf_ppo:layout -->"
PACKAGE = Path(__file__).resolve().parent.parent / "hf_ppo"  # the checkout's package, as mkdocstrings reads it
SECTION_COMMENT = re.compile(r"^\s*#\s*-{3,}\s*(?P<title>.*?)\s*-*\s*$")
DOCS_REFERENCE = re.compile(r"\bdocs/(?P<path>[\w/-]+\.md)")  # a page named by its path in a comment


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if PPO_CONFIG_MARKER in markdown:
        markdown = markdown.replace(PPO_CONFIG_MARKER, ppo_config_markdown(page.file.src_uri))
    if LAYOUT_MARKER in markdown:
        markdown = markdown.replace(LAYOUT_MARKER, layout_markdown())
    return markdown


# ---- reading PPOConfig ---------------------------------------------------------------------------------------------
def config_sections() -> list[tuple[str, list[dataclasses.Field]]]:
    """[(section comment, [its fields in source order])] for the fields `PPOConfig`'s own class body declares."""
    from hf_ppo import PPOConfig

    path = inspect.getsourcefile(PPOConfig)
    if path is None:
        raise PluginError("hooks.py: inspect.getsourcefile(PPOConfig) found no source file")
    source = Path(path).read_text(encoding="utf-8")
    lines = source.splitlines()
    classes = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef) and node.name == "PPOConfig"]
    if len(classes) != 1:
        raise PluginError(f"hooks.py: expected one `class PPOConfig` in {path}, found {len(classes)}")
    cls = classes[0]
    comments = [(number, match["title"]) for number in range(cls.lineno, cls.end_lineno + 1)
                if (match := SECTION_COMMENT.match(lines[number - 1]))]
    fields = {f.name: f for f in dataclasses.fields(PPOConfig)}
    sections: dict[str, list[dataclasses.Field]] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        if name not in fields:  # a ClassVar or an annotation without a field
            continue
        above = [title for number, title in comments if number < node.lineno]
        sections.setdefault(above[-1] if above else "Fields", []).append(fields[name])
    empty = [title for _, title in comments if title not in sections]
    if not sections or empty:
        raise PluginError(f"hooks.py: {path}: section comments without a field below them: {empty}" if empty
                          else f"hooks.py: no PPOConfig field found in {path}")
    return list(sections.items())


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return f"`{value!r}`"


# ---- rendering -------------------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    """Text for one Markdown table cell: on one line, `|` escaped outside code spans (inside them the table
    extension keeps it)."""
    return _escaped(" ".join(str(text).split()), "|")


def _escaped(text: str, extra: str = "") -> str:
    """`text` with Markdown's emphasis characters (and `extra`) escaped outside code spans: help texts are plain
    prose, where `__post_init__` or `a * b` must stay as written."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if part.startswith("`") else re.sub(f"([*_{re.escape(extra)}])", r"\\\1", part)
                   for part in parts)


def _split_title(comment: str) -> tuple[str, str]:
    """'Models: how the policy ... are loaded' -> ('Models', 'How the policy ... are loaded'); a colon inside
    parentheses does not split."""
    depth = 0
    for i, char in enumerate(comment):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == ":" and depth == 0:
            rest = comment[i + 1:].strip()
            return comment[:i].strip(), rest[:1].upper() + rest[1:]
    return comment.strip(), ""


def _relative(target: str, from_page: str) -> str:
    depth = from_page.count("/")
    return "../" * depth + target


def _link_docs_pages(text: str, page: str) -> str:
    return DOCS_REFERENCE.sub(lambda m: f"[{m['path']}]({_relative(m['path'], page)})", text)


def ppo_config_markdown(page: str = "reference/config.md") -> str:
    out = []
    for comment, fields in config_sections():
        title, lead = _split_title(comment)
        out.append(f"## {title}\n")
        if lead:
            out.append(_link_docs_pages(_escaped(lead), page).rstrip(".") + ".\n")
        out.append("| field | type | default | what it does |")
        out.append("|---|---|---|---|")
        for f in fields:
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            help_text = f.metadata.get("help", "")
            kind = " ".join(kind.split())  # in a code span: the table extension keeps its `|`
            out.append(f"| `{f.name}` | `{kind}` | {_cell(default_text(f))} | {_cell(help_text)} |")
        out.append("")
    return "\n".join(out)


# ---- the package's layout --------------------------------------------------------------------------------------------
FLOOR = re.compile(r"^Floor (?P<floor>\d+)\b")
SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bal)(?<!\bvs)[.!?](?=\s+[A-Z`(\"]|$)")
LAYOUT_WIDTH = 118  # the widest line of the block
LONG_SUMMARY = 200  # a first sentence longer than this is cut at its first colon ...
SHORT_SUMMARY = 25  # ... unless what comes before the colon is shorter than this (a bare name says too little)


def _docstring(path: Path) -> str:
    text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    if not text:
        raise PluginError(f"hooks.py: {path.relative_to(PACKAGE.parent)} has no docstring (the layout page shows it)")
    return text


def summary(docstring: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line, without Markdown's backticks; a sentence
    longer than LONG_SUMMARY characters is cut at its first colon outside brackets, when what comes before it says
    enough (SHORT_SUMMARY characters or more)."""
    paragraph = " ".join(docstring.split("\n\n")[0].split()).replace("`", "")
    end = SENTENCE_END.search(paragraph)
    sentence = paragraph[:end.end()] if end else paragraph
    if len(sentence) > LONG_SUMMARY:
        depth = 0
        for i, char in enumerate(sentence):
            depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(char, 0)
            if char == ":" and depth == 0 and sentence[i + 1:i + 2] == " ":
                if i >= SHORT_SUMMARY:
                    return sentence[:i]
                break
    return sentence.rstrip(".")


def _floor(package: Path) -> int:
    match = FLOOR.match(_docstring(package / "__init__.py"))
    if not match:
        raise PluginError(f"hooks.py: {package.relative_to(PACKAGE.parent)}/__init__.py: its docstring does not open "
                          "with its floor ('Floor N, ...')")
    return int(match["floor"])


def layout_entries(package: Path = PACKAGE) -> list[tuple[int, str, str]]:
    """[(depth, name, description)] of the layout tree, in its order: hf_ppo/'s own modules, then each sub-package
    (lowest floor first; its modules, then its data folders), each module with its docstring's summary."""
    def modules(folder: Path, depth: int) -> list[tuple[int, str, str]]:
        own = sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")
        return [(depth, p.name, summary(_docstring(p))) for p in own]

    def data(folder: Path, depth: int) -> list[tuple[int, str, str]]:
        found = []
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not (p / "__init__.py").exists()
                          and p.name != "__pycache__"):
            names = sorted(p.name for p in sub.iterdir() if p.is_file())
            found.append((depth, f"{sub.name}/", "data: " + ", ".join(names)))
        return found

    entries = [(0, f"{package.name}/", ""),
               (1, "__init__.py", summary(_docstring(package / "__init__.py"))), *modules(package, 1)]
    packages = [p for p in package.iterdir() if (p / "__init__.py").is_file()]
    for sub in sorted(packages, key=lambda p: (_floor(p), p.name)):
        entries.append((1, f"{sub.name}/", f"floor {_floor(sub)}"))
        entries += modules(sub, 2) + data(sub, 2)
    return entries


def layout_markdown(package: Path = PACKAGE) -> str:
    """The layout tree as a fenced block: names indented two spaces a level, descriptions in one column, wrapped."""
    entries = layout_entries(package)
    column = max(2 * depth + len(name) for depth, name, _ in entries) + 2
    lines = []
    for depth, name, description in entries:
        head = f"{'  ' * depth}{name}".ljust(column)
        words, line = description.split(), head
        for word in words:
            if len(line) + 1 + len(word) > LAYOUT_WIDTH and line.strip() and len(line) > column:
                lines.append(line.rstrip())
                line = " " * column
            line += ("" if len(line) == column else " ") + word
        lines.append(line.rstrip())
    return "```\n" + "\n".join(lines) + "\n```"


if __name__ == "__main__":  # print the generated Markdown: python docs/hooks.py [layout]
    import sys

    print(layout_markdown() if sys.argv[1:] == ["layout"] else ppo_config_markdown())
