"""The plugin host: discovers plugins through entry points, isolates broken ones, resolves declarations.

Builtin plugins are entry points of the ``padfree-plugins`` distribution itself, so they load exactly like
third-party ones. A host is an ordinary object (no module-level registry): create one per assembly or test.

Environment switches (comma-separated plugin names):

* ``PADFREE_PLUGINS_BLOCK``: never load these.
* ``PADFREE_PLUGINS_ALLOW``: load only these (builtins included, so name them too).

``PADFREE_PLUGINS_TRACE=1`` logs every assembly hook call to stderr: which plugin was asked and what it answered.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pluggy

from padfree_plugins.contract import hookspecs
from padfree_plugins.contract.declarations import Architecture, AttentionBackend, Task
from padfree_plugins.errors import PadfreeError, PluginError, did_you_mean

ENTRY_POINT_GROUP = "padfree_plugins"
OWN_DISTRIBUTION = "padfree-plugins"
DECLARATION_HOOKS = {
    "register_architectures": Architecture,
    "register_tasks": Task,
    "register_attention_backends": AttentionBackend,
}

#: The environment switches: comma-separated plugin names never to load, or the only ones to load.
BLOCK_ENV, ALLOW_ENV = "PADFREE_PLUGINS_BLOCK", "PADFREE_PLUGINS_ALLOW"
#: The switches that name the only plugins to load (the others name plugins not to load).
ALLOW_SWITCHES = (ALLOW_ENV, "the allow list")

Source = Literal["builtin", "entry point", "registered"]
Status = Literal["ok", "error", "blocked"]


@dataclass
class PluginRecord:
    """What the host knows about one plugin, loaded or not."""

    name: str
    source: Source
    version: str | None = None
    module: str = ""
    status: Status = "ok"
    error: str | None = None
    hooks: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    #: The transformers ``config.model_type`` values its architectures declare (``xlm-roberta`` for ``roberta``).
    model_types: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


#: How many filtered-out plugin names :meth:`PluginHost.filter_note` lists before "and N more".
FILTERED_SHOWN = 12


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return (dist.metadata["Name"] if dist is not None else None) or ""


def _hashable(plugin: object) -> bool:
    try:
        hash(plugin)
    except TypeError:
        return False
    return True


class _HashablePlugin(types.SimpleNamespace):
    """An unhashable plugin object (a ``SimpleNamespace`` of hook functions, say) as pluggy's sets need it: its
    public attributes, compared and hashed by identity."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @classmethod
    def of(cls, plugin: object) -> _HashablePlugin:
        return cls(**{name: getattr(plugin, name) for name in dir(plugin) if not name.startswith("__")})


def _answer_name(result: object) -> str:
    """How the trace shows a hook's answer: its type's name (``None`` for no answer)."""
    return "None" if result is None else type(result).__name__


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _split_env(value: str | None) -> set[str]:
    return {part.strip() for part in (value or "").split(",") if part.strip()}


class PluginHost:
    """Loads plugins and answers: which architectures, tasks and backends exist, and who provides them."""

    def __init__(
        self,
        plugins: Mapping[str, object] | None = None,
        *,
        entry_points: bool = True,
        block: Iterable[str] = (),
        allow: Iterable[str] | None = None,
        environ: Mapping[str, str] | None = None,
        trace: Callable[[str], Any] | None = None,
    ) -> None:
        environ = os.environ if environ is None else environ
        #: Where every assembly hook call is logged: ``trace``, or stderr with ``PADFREE_PLUGINS_TRACE=1``.
        self.trace = trace or (_stderr_line if environ.get("PADFREE_PLUGINS_TRACE", "") not in ("", "0") else None)
        #: Assembly hook name -> the plugin whose answer was used in its latest call (``None``: nobody answered).
        self.answered: dict[str, str | None] = {}
        self.env_block = _split_env(environ.get(BLOCK_ENV))
        self.env_allow = _split_env(environ.get(ALLOW_ENV))
        self.block = set(block) | self.env_block
        self.allow = None if allow is None and not self.env_allow else set(allow or ()) | self.env_allow
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.notes: list[str] = []
        #: (kind, name) -> the note on which plugin won a name several plugins claim (e.g. ("model type", "llama")).
        self.conflicts: dict[tuple[str, str], str] = {}
        self._declared: dict[str, dict[str, list[Any]]] = {}
        if entry_points:
            self._load_entry_points()
        for name, plugin in (plugins or {}).items():
            self.add(name, plugin)
        self._architectures = self._tasks = self._backends = None

    # -- loading -------------------------------------------------------------------------------------------------

    def _load_entry_points(self) -> None:
        # Deterministic whatever the order of sys.path and the file system: when two distributions use the same
        # plugin name, the builtin one loads, else the first by distribution name; the other gets an error row.
        found = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
                       key=lambda ep: (ep.name, _dist_name(ep) != OWN_DISTRIBUTION, _dist_name(ep), ep.value))
        for ep in found:
            dist = getattr(ep, "dist", None)
            source: Source = "builtin" if _dist_name(ep) == OWN_DISTRIBUTION else "entry point"
            record = PluginRecord(ep.name, source, dist.version if dist else None, ep.value)
            if ep.name in self.records:
                previous = self.records[ep.name]
                record.status, record.error = (
                    "error",
                    f"duplicate plugin name {ep.name!r}: also provided by {previous.module} "
                    f"({previous.version or '?'}); only the first one loaded",
                )
                self.records[f"{ep.name} ({ep.value})"] = record
                continue
            self.records[ep.name] = record
            if not self._allowed(record):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not take down the tool
                self._fail(record, f"import failed: {type(exc).__name__}: {exc}")
                continue
            self._register(record, plugin)

    def add(self, name: str, plugin: object, *, source: Source = "registered", version: str | None = None) -> None:
        """Register a plugin object (a module or any object with hook functions) under ``name``."""
        if name in self.records and self.records[name].status == "ok":
            raise PluginError(f"a plugin named {name!r} is already registered ({self.records[name].module})")
        if isinstance(plugin, (str, bytes, os.PathLike)):  # a name has no hooks: it would load as a plugin of none
            raise PluginError(
                f"plugin {name!r} is given as {plugin!r}, a name, not the plugin: pass the module (or object) holding "
                f"its hooks (import {plugin}, then {{{name!r}: {plugin}}}), or install it with an entry point in the "
                f"{ENTRY_POINT_GROUP!r} group, which the host loads by itself (docs/writing-a-plugin.md)")
        module = getattr(plugin, "__name__", type(plugin).__name__)
        record = PluginRecord(name, source, version, module)
        self.records[name] = record
        if self._allowed(record):
            self._register(record, plugin if _hashable(plugin) else _HashablePlugin.of(plugin))
        self._architectures = self._tasks = self._backends = None

    def _allowed(self, record: PluginRecord) -> bool:
        switch = self.blocked_by(record.name)
        if switch is not None:
            record.status = "blocked"
            record.error = f"not named in {switch}" if switch in ALLOW_SWITCHES else f"blocked by {switch}"
            return False
        return True

    def blocked_by(self, name: str) -> str | None:
        """The switch that keeps plugin ``name`` from loading (``PADFREE_PLUGINS_BLOCK``, ``plugins.block``,
        ``PADFREE_PLUGINS_ALLOW`` or ``the allow list``), or ``None``."""
        if name in self.env_block:
            return BLOCK_ENV
        if name in self.block:
            return "plugins.block"
        if self.allow is not None and name not in self.allow:
            return ALLOW_ENV if self.env_allow else "the allow list"
        return None

    def filtered(self) -> dict[str, list[str]]:
        """Switch -> the installed plugins it kept from loading (empty when no switch blocked anything)."""
        found: dict[str, list[str]] = {}
        for record in self.records.values():
            switch = self.blocked_by(record.name) if record.status == "blocked" else None
            if switch is not None:
                found.setdefault(switch, []).append(record.name)
        return found

    def filter_note(self, *wanted: str) -> str:
        """``" PADFREE_PLUGINS_ALLOW=a,b keeps 80 plugins from loading: …"``: what the block / allow switches
        filtered out, for an error about a missing task, architecture, backend or hook (``""`` when nothing was).
        Plugins named like ``wanted`` (the missing task, model type …) are listed first."""
        given = {BLOCK_ENV: f"{BLOCK_ENV}={','.join(sorted(self.env_block))}",
                 ALLOW_ENV: f"{ALLOW_ENV}={','.join(sorted(self.env_allow))}",
                 "plugins.block": f"plugins.block [{', '.join(sorted(self.block - self.env_block))}]"}
        sentences = []
        for switch, names in self.filtered().items():
            names = sorted(names, key=lambda n: (n not in wanted, n))
            shown = ", ".join(names[:FILTERED_SHOWN]) + (f" and {len(names) - FILTERED_SHOWN} more"
                                                         if len(names) > FILTERED_SHOWN else "")
            fix = "name the plugin you need in it" if switch in ALLOW_SWITCHES else "remove the plugin you need from it"
            plural = len(names) > 1
            sentences.append(f"{given.get(switch, switch)} keeps {len(names)} installed plugin{'s' * plural} from "
                             f"loading: {shown} (padfree-plugins list shows {'them' if plural else 'it'} as "
                             f"blocked); {fix}.")
        for name in sorted(self.env_allow - set(self.records)):
            sentences.append(f"{ALLOW_ENV} names {name!r}, which is not installed.{did_you_mean(name, self.records)}")
        return "".join(f" {sentence}" for sentence in sentences)

    def _fail(self, record: PluginRecord, message: str) -> None:
        record.status, record.error = "error", message

    def _register(self, record: PluginRecord, plugin: object) -> None:
        try:
            self.pm.register(plugin, name=record.name)
        except Exception as exc:  # noqa: BLE001 - pluggy validation errors, duplicate objects …
            self._fail(record, f"invalid plugin: {type(exc).__name__}: {exc}")
            return
        callers = self.pm.get_hookcallers(plugin) or ()
        unknown = [hc.name for hc in callers if hc.spec is None and not any(
            impl.plugin is plugin and impl.optionalhook for impl in hc.get_hookimpls())]
        if unknown:  # a misspelt hook would never be called: say so instead of loading a plugin that does nothing
            self.pm.unregister(plugin)
            specs = [name for name, caller in vars(self.pm.hook).items() if getattr(caller, "spec", None)]
            self._fail(record, f"unknown hook {unknown[0]!r}.{did_you_mean(unknown[0], specs)} "
                               f"Hooks: {', '.join(sorted(specs))}.")
            return
        record.hooks = tuple(sorted(hc.name for hc in callers))
        declared: dict[str, list[Any]] = {}
        for hook_name, spec_type in DECLARATION_HOOKS.items():
            if hook_name not in record.hooks:
                continue
            try:  # through pluggy's own calling (monitoring, specname=), asking this plugin alone
                answers = self._only(plugin, hook_name)()
                items = [item for answer in answers for item in (answer or ())]
                bad = [item for item in items if not isinstance(item, spec_type)]
                if bad:
                    raise TypeError(f"{hook_name} must return {spec_type.__name__} objects, got {bad[0]!r}")
            except Exception as exc:  # noqa: BLE001
                self.pm.unregister(name=record.name)
                self._fail(record, f"{hook_name} failed: {type(exc).__name__}: {exc}")
                record.hooks = ()
                return
            declared[hook_name] = items
        record.architectures = tuple(a.name for a in declared.get("register_architectures", ()))
        record.model_types = tuple(dict.fromkeys(t for a in declared.get("register_architectures", ())
                                                 for t in a.model_types))
        record.tasks = tuple(t.name for t in declared.get("register_tasks", ()))
        record.backends = tuple(b.name for b in declared.get("register_attention_backends", ()))
        self._declared[record.name] = declared

    # -- queries -------------------------------------------------------------------------------------------------

    def loaded(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if r.status == "ok"]

    def require(self, names: Iterable[str]) -> None:
        """Raise :class:`PluginError` unless every named plugin loaded."""
        for name in names:
            record = self.records.get(name)
            if record is None:
                raise PluginError(
                    f"required plugin {name!r} is not installed.{did_you_mean(name, self.records)} "
                    f"Installed: {', '.join(sorted(self.records)) or 'none'}."
                )
            if record.status != "ok":
                raise PluginError(f"required plugin {name!r} is {record.status}: {record.error}")

    def _candidates(self, hook_name: str) -> list[tuple[Any, PluginRecord]]:
        return [
            (item, self.records[plugin_name])
            for plugin_name, declared in self._declared.items()
            if self.records[plugin_name].status == "ok"
            for item in declared.get(hook_name, ())
        ]

    def _pick(self, kind: str, key: str, options: list[tuple[Any, PluginRecord]]) -> tuple[Any, str]:
        """Deterministic precedence: higher priority, then third-party over builtin, then plugin name."""
        options = sorted(options, key=lambda o: (-o[0].priority, o[1].source == "builtin", o[1].name))
        if len(options) > 1:
            losers = ", ".join(f"{o[1].name}:{o[0].name}" for o in options[1:])
            winner = f"{options[0][1].name}:{options[0][0].name}"
            note = f"{kind} {key!r} is claimed by several plugins: using {winner} over {losers}"
            if note not in self.notes:
                self.notes.append(note)
            self.conflicts[(kind, key)] = note
        return options[0][0], options[0][1].name

    def _by_name(self, hook_name: str, kind: str) -> dict[str, tuple[Any, str]]:
        grouped: dict[str, list[tuple[Any, PluginRecord]]] = {}
        for item, record in self._candidates(hook_name):
            grouped.setdefault(item.name, []).append((item, record))
        return {name: self._pick(kind, name, options) for name, options in sorted(grouped.items())}

    def architectures(self) -> dict[str, tuple[Architecture, str]]:
        """``config.model_type`` -> (winning architecture spec, plugin name)."""
        if self._architectures is None:
            grouped: dict[str, list[tuple[Any, PluginRecord]]] = {}
            for item, record in self._candidates("register_architectures"):
                for model_type in item.model_types:
                    grouped.setdefault(model_type, []).append((item, record))
            self._architectures = {
                model_type: self._pick("model type", model_type, options)
                for model_type, options in sorted(grouped.items())
            }
        return self._architectures

    def tasks(self) -> dict[str, tuple[Task, str]]:
        """Task name -> (winning spec, plugin name)."""
        if self._tasks is None:
            self._tasks = self._by_name("register_tasks", "task")
        return self._tasks

    def backends(self) -> dict[str, tuple[AttentionBackend, str]]:
        """Backend name -> (winning spec, plugin name)."""
        if self._backends is None:
            self._backends = self._by_name("register_attention_backends", "attention backend")
        return self._backends

    def architecture_for(self, model_type: str) -> Architecture | None:
        """The architecture that handles a transformers ``config.model_type``, if any plugin declares it."""
        found = self.architectures().get(model_type)
        return found[0] if found else None

    @property
    def hook(self):
        """The pluggy hook relay (``host.hook.collate(...)``) — call it at assembly only."""
        return self.pm.hook

    def _only(self, plugin: object, hook_name: str) -> Any:
        """``hook_name``'s caller restricted to ``plugin``'s implementations (pluggy's own calling)."""
        others = [other for other in self.pm.get_plugins() if other is not plugin]
        return self.pm.subset_hook_caller(hook_name, remove_plugins=others)

    def call_first(self, hook_name: str, *, returns_callable: bool = False, **kwargs: Any) -> Any:
        """Call an assembly (``firstresult``) hook with pluggy's semantics — the first answer other than ``None``
        wins, the last-registered plugin is asked first, ``trylast`` ones last — one plugin at a time through
        pluggy's own calling, so that monitoring sees every call and ``specname=`` implementations count. Records
        which plugin answered (:attr:`answered`); when a plugin raises something other than a padfree-plugins
        error, or (``returns_callable``) answers with something that cannot be called, says which plugin it was and
        how to block it."""
        caller = getattr(self.pm.hook, hook_name)
        implementations = caller.get_hookimpls()
        if any(impl.hookwrapper or impl.wrapper for impl in implementations):
            self.answered[hook_name] = "(hook wrappers)"
            result = caller(**kwargs)  # wrappers wrap every other implementation: one call of them all
            self._trace(f"{hook_name}: (hook wrappers) -> {_answer_name(result)}")
            return result
        asked = list(dict.fromkeys(impl.plugin_name for impl in reversed(implementations)))
        for name in asked:
            try:
                result = self._only(self.pm.get_plugin(name), hook_name)(**kwargs)
            except PadfreeError:
                raise
            except Exception as error:
                raise PluginError(
                    f"plugin {name!r} failed in its {hook_name} hook: {type(error).__name__}: {error}. If this "
                    f"model does not need it, block it: plugins.block: [{name}] in the config, or "
                    f"PADFREE_PLUGINS_BLOCK={name}"
                ) from error
            self._trace(f"{hook_name}: {name} -> {_answer_name(result)}")
            if result is not None:
                if returns_callable and not callable(result):
                    raise PluginError(f"plugin {name!r} answered its {hook_name} hook with a "
                                      f"{type(result).__name__}, not a callable (docs/writing-a-plugin.md)")
                self.answered[hook_name] = name
                return result
        self.answered[hook_name] = None
        return None

    def trace_not_called(self, hook_name: str, why: str) -> None:
        """Log (when tracing) that an assembly hook is not called, and why (``plan()`` has no model to patch)."""
        self._trace(f"{hook_name}: not called ({why})")

    def _trace(self, line: str) -> None:
        if self.trace is not None:
            self.trace(f"padfree-plugins hook {line}")
