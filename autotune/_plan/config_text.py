"""Reading LightningCLI config text, for tuned files, spaces and targets alike: YAML that refuses a key written twice,
its errors in one line, the keys a config may hold and a constructor takes, its callback entries, and a hint at the
nearest accepted name for a misspelt one."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import yaml

__all__ = ["CLI_CONFIG_KEYS", "callback_entries", "constructor_arguments", "did_you_mean", "safe_load_unique",
           "yaml_problem"]


#: The top-level keys of a LightningCLI ``fit`` config (a tuned file may be merged into one; targets read them too).
CLI_CONFIG_KEYS = ("model", "data", "trainer", "seed_everything", "optimizer", "lr_scheduler", "ckpt_path")


@functools.cache
def constructor_arguments(class_path: str) -> frozenset[str]:
    """The arguments of a class's constructor, by its import path (read once per class)."""
    import importlib
    import inspect

    module, _, name = class_path.rpartition(".")
    return frozenset(inspect.signature(getattr(importlib.import_module(module), name)).parameters)


def did_you_mean(name: Any, accepted: Sequence[str]) -> str:
    """``"; did you mean 'trainer'?"`` where ``name`` is close to one of ``accepted``, else ``""``.

    Example:
        >>> did_you_mean("trainr", CLI_CONFIG_KEYS)
        "; did you mean 'trainer'?"
    """
    import difflib

    close = difflib.get_close_matches(str(name), list(accepted), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def callback_entries(doc: Any) -> list[tuple[str, str, Any]]:
    """Where, class path and ``init_args`` of each ``trainer.callbacks`` / ``trainer.callbacks+`` entry of a
    LightningCLI config document (a list or one entry) that names a class path; anything else is skipped.

    Example:
        >>> callback_entries({"trainer": {"callbacks+": [{"class_path": "a.B", "init_args": {"x": 1}}]}})
        [('trainer.callbacks+[0]', 'a.B', {'x': 1})]
    """
    trainer = doc.get("trainer") if isinstance(doc, dict) else None
    entries = []
    for key_name in ("callbacks", "callbacks+"):
        listed = trainer.get(key_name) if isinstance(trainer, dict) else None
        listed = [listed] if isinstance(listed, dict) else listed if isinstance(listed, list) else []
        for i, entry in enumerate(listed):
            if isinstance(entry, dict) and isinstance(entry.get("class_path"), str):
                entries.append((f"trainer.{key_name}[{i}]", entry["class_path"], entry.get("init_args") or {}))
    return entries


class _UniqueKeys(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping repeating a key (PyYAML keeps the last one silently)."""


def _mapping_without_repeats(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``, which construct_mapping merges
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            repeated = key in seen
        except TypeError:  # an unhashable key: construct_mapping reports it
            break
        if repeated:
            raise yaml.constructor.ConstructorError(
                None, None, f"key '{key}' appears twice (line {key_node.start_mark.line + 1}); keep one", None)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_repeats)


def yaml_problem(err: BaseException) -> str:
    """A YAML error in one line, with its line and column where PyYAML knows them.

    Example:
        >>> try:
        ...     safe_load_unique("a: [1, 2\\nb: 3")
        ... except yaml.YAMLError as err:
        ...     print(yaml_problem(err))
        expected ',' or ']', but got ':' at line 2, column 2 (while parsing a flow sequence)
    """
    mark = getattr(err, "problem_mark", None)
    problem, context = getattr(err, "problem", None), getattr(err, "context", None)
    if mark is None or not problem:
        return " ".join(str(err).split())
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" + (f" ({context})" if context else "")


def safe_load_unique(text: str) -> Any:
    r"""``yaml.safe_load`` of ``text``, refusing a mapping that repeats a key (tuned files, spaces, configs).

    Example:
        >>> safe_load_unique("budget: 16GiB\nbudget: 8GiB")
        Traceback (most recent call last):
        ...
        yaml.constructor.ConstructorError: key 'budget' appears twice (line 2); keep one
    """
    return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader subclass
