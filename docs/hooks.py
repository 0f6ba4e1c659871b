"""MkDocs hook (`hooks:` in mkdocs.yml): pages generated from the code at build time, so they cannot drift from it.

`<!-- hf_ppo:ppo-config -->` in a page becomes the `PPOConfig` reference: one table per section of the class body
(the `# ---- Section name ----` comment lines of the source file), each field with its type, default and help, read
from `dataclasses.fields(PPOConfig)`. The source file is found with `inspect.getsourcefile(PPOConfig)`, so the hook
follows the class wherever it lives. A field added to `PPOConfig` appears here at the next build, and a section
comment that no longer matches any field fails the build.

A docs page named inside a section comment (`(docs/concepts/critics.md)`) becomes a link to that page.
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
SECTION_COMMENT = re.compile(r"^\s*#\s*-{3,}\s*(?P<title>.*?)\s*-*\s*$")
DOCS_REFERENCE = re.compile(r"\bdocs/(?P<path>[\w/-]+\.md)")  # a page named by its path in a comment


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if PPO_CONFIG_MARKER not in markdown:
        return markdown
    return markdown.replace(PPO_CONFIG_MARKER, ppo_config_markdown(page.file.src_uri))


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


if __name__ == "__main__":  # print the generated Markdown: python docs/hooks.py
    print(ppo_config_markdown())
