"""Strict reading of ``task_options`` (padfree.yaml): unknown keys and bad values are errors.

A task declares its options with their defaults (``Task.options``); :func:`padfree_plugins.plan` checks the
config against them, and the task's hooks read the values with :func:`read_options`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from padfree_plugins.config.schema import bare_word_hint
from padfree_plugins.errors import ConfigError, did_you_mean

#: The kind of value an option must have, from the type of its default (a default of None takes anything).
_KINDS = {bool: (bool, "true or false"), str: (str, "a string"), dict: (Mapping, "a mapping"),
          list: ((list, tuple), "a list")}


def read_options(task: str, options: Mapping[str, Any], defaults: Mapping[str, Any],
                 choices: Mapping[str, tuple] | None = None) -> dict[str, Any]:
    """``defaults`` updated with ``options``; a :class:`ConfigError` for an unknown key, a value of another kind
    than its default's, or a value not in ``choices``."""
    for key in options:
        if key not in defaults:
            raise ConfigError(
                f"task_options: {key!r} is not an option of task {task!r}.{did_you_mean(str(key), defaults)} "
                + (f"Options: {', '.join(defaults)}." if defaults else "It takes no options.")
            )
    values = {**defaults, **options}
    for key, value in options.items():
        expected = _KINDS.get(type(defaults[key]))
        if expected is not None and not isinstance(value, expected[0]):
            hint = bare_word_hint(value) if expected[0] is str else ""
            raise ConfigError(f"task_options: {key} of task {task!r} must be {expected[1]}, got {value!r}.{hint}")
    for key, allowed in (choices or {}).items():
        if values[key] not in allowed:
            raise ConfigError(
                f"task_options: {key} of task {task!r} must be one of {', '.join(map(repr, allowed))}, "
                f"got {values[key]!r}.{did_you_mean(str(values[key]), map(str, allowed))}"
                + (bare_word_hint(values[key]) if isinstance(values[key], bool) else "")
            )
    return values
