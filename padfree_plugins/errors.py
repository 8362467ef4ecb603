"""Exceptions raised by padfree-plugins. Every message says what went wrong and what to do."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PadfreeError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(PadfreeError, ValueError):
    """An acceleration config (``padfree.yaml``) is malformed or names something unknown."""


class BatchError(PadfreeError, ValueError):
    """A batch of examples cannot be packed (empty, zero-length or over-long example, missing key, bad dtype)."""


class BoundaryError(PadfreeError, RuntimeError):
    """A packed row reached attention without its example boundaries: it would mix examples."""


class UnsupportedArchitectureError(PadfreeError, ValueError):
    """No plugin declares support for a model's architecture."""


class BackendUnavailableError(PadfreeError, RuntimeError):
    """A requested attention backend is missing or cannot run this model."""


class PluginError(PadfreeError, RuntimeError):
    """A required plugin failed to load or misbehaved."""


#: How alike (``difflib`` ratio, 0 to 1) a choice must be to a name to be suggested for it: a typo of one or two
#: letters ('lats' -> 'last', 'lamma' -> 'llama', 'atention' -> 'attention') is; a name that merely shares a few
#: letters ('opt' and 'mpnet': 0.5) is not.
SUGGESTION_CUTOFF = 0.75


def did_you_mean(name: str, choices: Iterable[str], cutoff: float = SUGGESTION_CUTOFF) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest choice when it is a likely typo of ``name`` (at least
    ``cutoff`` alike), or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=cutoff)
    return f" Did you mean {close[0]!r}?" if close else ""
