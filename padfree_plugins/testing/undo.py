"""Check that undoing an assembly gives the model back exactly as it was.

    before = model_state(model)
    assembly = assemble(model, config)
    ...
    assembly.undo()
    assert_state_restored(before, model)

:func:`model_state` records, for every module, what its instance holds (``__dict__``: an instance ``forward``, the
forward hooks and the other hook tables, parameters, buffers, attributes), the instance attributes of every config
the modules hold (the attention implementation among them), and the packed-call markers the patches set during a
forward (``PACKED_CALL``, ``PACKED_ROW``). :func:`assert_state_restored` names every difference. The attention
implementation's name stays in transformers' registry after ``undo`` (the registry has no public way to remove a
name); nothing else of an assembly may remain on the model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from padfree_plugins.modeling.attention import PACKED_CALL
from padfree_plugins.modeling.mixers import PACKED_ROW

#: Values compared by equality (any other value must be the same object).
PLAIN = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, enum.Enum)


@dataclass
class ModelState:
    """What :func:`model_state` recorded: per module name, per config and per marker, the values held."""

    modules: dict[str, dict[str, Any]]
    configs: dict[str, dict[str, Any]]
    markers: dict[str, Any]


def _shallow(namespace: dict) -> dict[str, Any]:
    """``namespace`` with its dict, list and set values copied one level (the hook tables are mutated in place)."""
    return {key: type(value)(value) if isinstance(value, (dict, list, set)) else value
            for key, value in namespace.items()}


def _configs(model: torch.nn.Module) -> dict[str, Any]:
    """Every config object the modules hold (and the configs inside them), by where it was first found."""
    found: dict[int, tuple[str, Any]] = {}
    pending = [(f"{name or 'model'}.config", module.__dict__["config"]) for name, module in model.named_modules()
               if hasattr(module.__dict__.get("config"), "to_dict")]
    while pending:
        where, config = pending.pop(0)
        if id(config) in found:
            continue
        found[id(config)] = (where, config)
        pending += [(f"{where}.{key}", value) for key, value in vars(config).items() if hasattr(value, "to_dict")]
    return {where: config for where, config in found.values()}


def model_state(model: torch.nn.Module) -> ModelState:
    """What ``model``'s modules and configs hold now, for :func:`assert_state_restored`."""
    return ModelState({name: _shallow(vars(module)) for name, module in model.named_modules()},
                      {where: _shallow(vars(config)) for where, config in _configs(model).items()},
                      {"PACKED_CALL": PACKED_CALL.get(), "PACKED_ROW": PACKED_ROW.get()})


def _same(before: Any, after: Any) -> bool:
    if before is after:
        return True
    if isinstance(before, (dict, list)) and type(before) is type(after) and len(before) == len(after):
        pairs = zip(before.items(), after.items()) if isinstance(before, dict) else zip(before, after)
        if isinstance(before, dict):
            return all(kb == ka and _same(vb, va) for (kb, vb), (ka, va) in pairs)
        return all(_same(b, a) for b, a in pairs)
    if isinstance(before, set):
        return before == after
    return isinstance(before, PLAIN) and type(before) is type(after) and before == after


def _describe(value: Any) -> str:
    if isinstance(value, (dict, list, set)):
        items = value.values() if isinstance(value, dict) else value
        text = f"{type(value).__name__} of {len(value)}: [{', '.join(_describe(item) for item in items)}]"
    else:
        text = repr(value) if isinstance(value, PLAIN) else type(value).__name__
    return text if len(text) < 160 else text[:157] + "..."


def differences(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], kind: str) -> list[str]:
    """Every attribute that differs between two records of one kind (modules or configs), as sentences."""
    found = []
    for name in sorted(set(before) | set(after)):
        if name not in after or name not in before:
            found.append(f"{kind} {name!r} {'is gone' if name not in after else 'was added'}")
            continue
        old, new = before[name], after[name]
        for key in sorted(set(old) | set(new)):
            if key not in new:
                found.append(f"{kind} {name or 'model'}: {key} ({_describe(old[key])}) is gone")
            elif key not in old:
                found.append(f"{kind} {name or 'model'}: {key} was added ({_describe(new[key])})")
            elif not _same(old[key], new[key]):
                found.append(f"{kind} {name or 'model'}: {key} is {_describe(new[key])}, was {_describe(old[key])}")
    return found


def assert_state_restored(before: ModelState, model: torch.nn.Module) -> None:
    """Raise ``AssertionError`` naming every attribute, hook, config value or marker of ``model`` that differs from
    ``before`` (a :func:`model_state` taken before the assembly)."""
    after = model_state(model)
    found = differences(before.modules, after.modules, "module")
    found += differences(before.configs, after.configs, "config")
    found += [f"{key} is {_describe(after.markers[key])}, was {_describe(value)}"
              for key, value in before.markers.items() if not _same(value, after.markers[key])]
    if found:
        raise AssertionError(f"undo left {len(found)} difference(s) on {type(model).__name__}:\n  " +
                             "\n  ".join(found[:40]))
