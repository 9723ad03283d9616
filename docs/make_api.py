"""Write docs/api.md from the docstrings of the public API: ``python docs/make_api.py`` (a test keeps it current)."""

from __future__ import annotations

import inspect
from pathlib import Path

import autotune
import autotune.callbacks

HEADER = "# API reference\n\nGenerated from the docstrings by `python docs/make_api.py`; do not edit by hand.\n"


def _entry(module_name: str, name: str, obj: object) -> str:
    title = f"## `{module_name}.{name}`\n"
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return f"{title}\n`{name} = {obj!r}`\n"
    try:
        signature = f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        signature = name
    kind = "class" if inspect.isclass(obj) else "def"
    doc = inspect.getdoc(obj) or ""
    text = f"{title}\n```python\n{kind} {signature}\n```\n\n```text\n{doc}\n```\n"
    if inspect.isclass(obj):
        for member, value in sorted(vars(obj).items()):
            if member.startswith("_") or not (inspect.isfunction(value) or isinstance(value, (property, classmethod))):
                continue
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            first = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
            text += f"- `{member}`: {first}\n"
    return text


def render() -> str:
    parts = [HEADER]
    for module in (autotune, autotune.callbacks):
        for name in sorted(module.__all__):
            if name.startswith("_"):
                continue
            parts.append(_entry(module.__name__, name, getattr(module, name)))
    return "\n".join(parts)


if __name__ == "__main__":
    Path(__file__).with_name("api.md").write_text(render())
