"""Shared fixtures: tiny models built from configs (no downloads), example batches, fake plugin distributions."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from padfree_plugins import testing
from padfree_plugins.testing import VOCAB, split_packed, tiny_config  # noqa: F401 - re-exported to the tests

__all__ = ["VOCAB", "make_examples", "per_example", "split_packed", "tiny_config", "tiny_model"]


def tiny_model(model_type: str, head: str = "base", attn_implementation: str = "sdpa", **overrides):
    """A randomly initialised tiny model in eval mode, fp32, seeded (``eager`` for models without sdpa: MPNet)."""
    return testing.tiny_model(model_type, head, attn_implementation=attn_implementation, **overrides)


def make_examples(lengths, seed: int = 0, low: int = 5, **extra_token_keys):
    """Examples with random token ids of the given lengths (ids >= ``low`` avoid special tokens)."""
    return testing.random_examples(lengths, VOCAB, seed=seed, low=low)


def per_example(model, examples, **kwargs):
    """Each example run alone through ``model`` (the reference a packed forward must equal)."""
    return [testing.run_alone(model, {"input_ids": ex["input_ids"]}, **kwargs) for ex in examples]


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    """Install a throwaway plugin distribution on ``sys.path``: ``fake_distribution(name, module_source)``.

    Writes ``<module>.py`` plus a ``*.dist-info`` with an entry point in the ``padfree_plugins`` group, so the
    host discovers it exactly as it would a pip-installed package.
    """

    def install(entry_name: str, source: str, module: str | None = None, dist: str | None = None) -> Path:
        module = module or f"fake_plugin_{entry_name.replace('-', '_')}"
        dist = dist or f"fake-{entry_name}"
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{dist.replace('-', '_')}-0.0.1.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
        entry_points = info / "entry_points.txt"
        existing = entry_points.read_text() if entry_points.exists() else "[padfree_plugins]\n"
        entry_points.write_text(existing + f"{entry_name} = {module}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        sys.modules.pop(module, None)
        return tmp_path

    return install


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread per test process: tiny models gain nothing from more, and with ``-n 2`` on a 2-core
    machine oversubscribed OpenMP threads make every small kernel many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def packed_calls(monkeypatch):
    """What every call of :func:`padfree_plugins.modeling.unpad.pack_padded_call` returned: packed (``True``) or
    left padded (``False``)."""
    from padfree_plugins.modeling import unpad

    return counted_packings(monkeypatch, unpad, "pack_padded_call")


def counted_packings(monkeypatch, module, name: str) -> list[bool]:
    """``module.name`` (a function answering a packed call or ``None``) recorded: ``True`` for each call it packed,
    ``False`` for each it left padded."""
    calls = []
    original = getattr(module, name)

    def counting(*args):
        result = original(*args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(module, name, counting)
    return calls
