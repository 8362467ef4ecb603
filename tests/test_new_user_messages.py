"""What a new user found in the error messages: an unsupported model type was told "Did you mean 'mpnet'?" for
``opt``, and ``attention: flash_attn`` on a CPU only said to pip install flash-attn."""

from __future__ import annotations

import pytest

from padfree_plugins import BackendUnavailableError, ConfigError, UnsupportedArchitectureError, plan
from padfree_plugins.errors import did_you_mean
from tests.conftest import tiny_config


@pytest.mark.parametrize("model_type", ["opt", "gpt2", "hubert", "mpt"])
def test_an_unsupported_model_type_gets_no_lookalike_and_always_probe_and_the_guide(model_type):
    """The model type is the model's own, not a typo: a name spelt alike ('opt' ~ 'mpnet', 'hubert' ~ 'bert') says
    nothing about its architecture, so none is suggested; the ways forward always are."""
    with pytest.raises(UnsupportedArchitectureError) as info:
        plan(tiny_config(model_type), {}, device_type="cpu")
    message = str(info.value)
    assert f"model type {model_type!r} is not supported" in message
    assert "Did you mean" not in message and "'mpnet'" not in message
    assert "architecture: probe" in message and "docs/writing-a-plugin.md" in message
    assert "Supported model types:" in message and "llama" in message


def test_suggestions_are_close_matches_only():
    assert did_you_mean("opt", ["mpnet", "llama", "bert"]) == ""
    assert did_you_mean("gpt2", ["gpt_neox", "qwen2"]) == ""
    assert did_you_mean("lamma", ["llama", "gemma"]) == " Did you mean 'llama'?"
    assert did_you_mean("atention", ["attention", "task"]) == " Did you mean 'attention'?"
    assert did_you_mean("lats", ["last", "mean"]) == " Did you mean 'last'?"  # two letters swapped


def test_a_mistyped_architecture_is_suggested_and_points_to_probe_and_the_guide():
    with pytest.raises(ConfigError) as info:
        plan(tiny_config("llama"), {"architecture": "lama"}, device_type="cpu")
    message = str(info.value)
    assert "architecture 'lama' is not provided by any plugin. Did you mean 'llama'?" in message
    assert "'probe'" in message and "docs/writing-a-plugin.md" in message
    with pytest.raises(ConfigError) as info:
        plan(tiny_config("llama"), {"architecture": "opt"}, device_type="cpu")
    assert "Did you mean" not in str(info.value) and "'probe'" in str(info.value)


@pytest.mark.parametrize(("backend", "needs"), [
    ("flash_attn", "pip install flash-attn"),
    ("varlen", "torch >= 2.10"),
])
def test_a_cuda_backend_on_a_cpu_says_it_is_cuda_only_and_what_to_use(backend, needs):
    with pytest.raises(BackendUnavailableError) as info:
        plan(tiny_config("llama"), {"attention": backend}, device_type="cpu")
    message = str(info.value)
    assert f"attention backend {backend!r} was requested but cannot be used on cpu" in message
    assert "CUDA-only" in message and needs in message
    assert "On cpu use attention: auto (it picks exact here) or exact." in message


def test_a_gpu_backend_on_a_cpu_names_its_devices():
    with pytest.raises(BackendUnavailableError) as info:
        plan(tiny_config("llama"), {"attention": "repad"}, device_type="cpu")
    message = str(info.value)
    assert "it is CUDA / Intel XPU / Apple MPS-only" in message and "attention: auto (it picks exact here)" in message
