"""Shared fixtures: tiny models built from configs (no downloads), example batches, fake plugin distributions."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

VOCAB = 128


def tiny_config(model_type: str, **overrides):
    """A tiny transformers config of ``model_type`` (2 layers, d=64, 4 heads)."""
    from transformers import AutoConfig

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=256, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


def tiny_model(model_type: str, head: str = "base", attn_implementation: str = "sdpa", **overrides):
    """A randomly initialised tiny model in eval mode, fp32, seeded (``eager`` for models without sdpa: MPNet)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(0)
    factory = {"base": AutoModel, "causal_lm": AutoModelForCausalLM, "seq_cls": AutoModelForSequenceClassification}
    config = tiny_config(model_type, **overrides)
    config._attn_implementation = attn_implementation
    return factory[head].from_config(config, attn_implementation=attn_implementation).eval()


def make_examples(lengths, seed: int = 0, low: int = 5, **extra_token_keys):
    """Examples with random token ids of the given lengths (ids >= ``low`` avoid special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(low, VOCAB, (n,), generator=generator).tolist()} for n in lengths]


def per_example(model, examples, **kwargs):
    """Each example run alone through ``model`` (the reference a packed forward must equal)."""
    return [model(input_ids=torch.tensor([ex["input_ids"]]), **kwargs) for ex in examples]


def split_packed(tensor, batch):
    """``[1, T, ...]`` -> list of per-example ``[L_i, ...]``."""
    cu = batch["cu_seq_lens_q"].tolist()
    return [tensor[0, cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


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
