"""No host synchronisation in a padding-free training step: the forward and backward of every builtin task run with
the model and the packed batch on the ``meta`` device, where anything that reads a value back to the host
(``.item()``, ``.tolist()``, ``bool(tensor)``, ``nonzero()``, a boolean mask, ``repeat_interleave`` without
``output_size`` …) raises, and copies from the host to the device are recorded (a blocking copy waits for the
device too). On a GPU each of those would stall the step, once per layer or per example at worst.

The attention backend is ``repad`` (registered for accelerators, computed here on ``meta``); the boundary check
that reads ``cu_seq_lens`` on the host runs for host tensors only, so it is skipped as on a GPU.
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from padfree_plugins import PluginHost, assemble, hookimpl
from padfree_plugins.modeling.neftune import PackedNeftune
from tests.conftest import make_examples
from tests.tasks_common import model_for, pair_examples


class HostToDeviceCopies(TorchFunctionMode):
    """Records every copy of a host tensor onto the ``meta`` device (what would be a host-to-device copy)."""

    def __init__(self):
        super().__init__()
        self.copies: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        source = args[-1] if name == "copy_" else (args[0] if args else None)
        from_host = isinstance(source, torch.Tensor) and source.device.type == "cpu" or name in ("tensor", "as_tensor")
        if name in ("to", "cuda", "copy_", "tensor", "as_tensor") and from_host and isinstance(out, torch.Tensor) \
                and out.device.type == "meta":
            frame = traceback.extract_stack(limit=3)[0]
            self.copies.append(f"{name} at {frame.filename}:{frame.lineno}")
        return out


def repad_host() -> PluginHost:
    spec = PluginHost().backends()["repad"][0]

    class RepadOnMeta:
        @hookimpl
        def register_attention_backends(self):
            return [dataclasses.replace(spec, name="repad_meta", devices=("cpu", "meta"))]

    return PluginHost({"repad_meta": RepadOnMeta()})


@pytest.fixture
def no_packed_detection(monkeypatch):
    """transformers' own packed-sequence detection in ``create_causal_mask`` reads the device once per decoder
    forward (outside this project; padding-free attention does not use its result): answered without reading."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)


def labelled(examples, labels):
    return [{**example, "label": label} for example, label in zip(examples, labels)]


LENGTHS = [3, 7, 1, 5, 7, 2]
EMBEDDING_ROWS = [{"anchor_input_ids": a["input_ids"], "positive_input_ids": b["input_ids"], "anchor_prompt_length": 1}
                  for a, b in zip(make_examples([3, 7, 2, 5]), make_examples([4, 1, 6, 6], seed=1))]
CASES = {
    "causal_lm": ("llama", "causal_lm", {"task": "causal_lm"}, make_examples(LENGTHS)),
    "seq_cls bert": ("bert", "seq_cls", {"task": "seq_cls", "task_options": {"pairs": True}},
                     labelled(pair_examples(LENGTHS), [0, 1, 2, 0, 1, 2])),
    "seq_cls qwen3": ("qwen3", "seq_cls", {"task": "seq_cls"}, labelled(make_examples(LENGTHS), [0, 1, 2, 0, 1, 2])),
    "reranker pointwise": ("bert", "seq_cls1", {"task": "reranker"},
                           labelled(pair_examples(LENGTHS), [1.0, 0.0, 0.5, 0.0, 1.0, 0.0])),
    "reranker listwise": ("bert", "seq_cls1", {"task": "reranker", "task_options": {"objective": "listwise"}},
                          [{"input_ids": [ex["input_ids"] for ex in pair_examples(lengths, seed=seed)],
                            "token_type_ids": [ex["token_type_ids"] for ex in pair_examples(lengths, seed=seed)],
                            "labels": labels} for seed, lengths, labels in ((0, [3, 7, 1], [0, 1, 0]),
                                                                             (1, [5, 2], [1, 0]))]),
    "reranker yes_no": ("qwen3", "causal_lm", {"task": "reranker", "task_options": {
        "scorer": "yes_no", "yes_token_id": 7, "no_token_id": 9, "pairs": False}},
        labelled(make_examples(LENGTHS), [1.0, 0.0, 1.0, 0.0, 1.0, 0.0])),
    **{f"embedding {mode}": ("bert", "base", {"task": "embedding", "pooling": mode, "task_options": {
        "loss": "MultipleNegativesRankingLoss", "normalize": True}}, EMBEDDING_ROWS)
       for mode in ("first", "last", "mean", "max", "weighted_mean", "mean_sqrt_len")},
    **{f"embedding {mode} without prompt": ("bert", "base", {"task": "embedding", "pooling": mode, "task_options": {
        "loss": "MultipleNegativesRankingLoss", "include_prompt": False}}, EMBEDDING_ROWS)
       for mode in ("first", "mean", "weighted_mean")},
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_step_never_waits_for_the_device(case, no_packed_detection):
    name, head, config, rows = CASES[case]
    model = model_for(name, head="seq_cls" if head.startswith("seq_cls") else head,
                      **({"num_labels": 1} if head == "seq_cls1" else {"num_labels": 3} if head == "seq_cls" else {}))
    assembly = assemble(model, {**config, "attention": "repad_meta"}, host=repad_host())
    batch = assembly.collator(rows)
    neftune = PackedNeftune.install(model.get_input_embeddings(), 5.0) if case == "causal_lm" else None
    model.to("meta").train()
    batch = type(batch)({k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
    kwargs = {"use_cache": False} if head == "causal_lm" else {}  # as the trainers call it
    for step in range(2):  # the second step is checked: what the first one makes on the device once is cached
        with HostToDeviceCopies() as mode, neftune.for_batch(batch) if neftune else torch.enable_grad():
            loss = assembly.forward(model, batch, **kwargs).loss
            loss.backward()
    assert loss.device.type == "meta"
    assert mode.copies == []  # ids, labels … are on the device already


def test_contrastive_tension_labels_are_computed_on_the_device():
    """Labels of ContrastiveTensionLoss on packed columns (same tokens or not), with nothing read per text."""
    losses = pytest.importorskip("padfree_sentence_transformers.losses")
    from padfree_plugins import PackingCollator

    first = [[5, 6, 7], [8], [9, 9], [5, 6], [7, 7, 7]]
    second = [[5, 6, 7], [8, 8], [9, 9], [5], [7, 7, 6]]
    collate = PackingCollator()
    columns = [collate([{"input_ids": ids} for ids in column]) for column in (first, second)]
    want = torch.tensor([float(a == b) for a, b in zip(first, second)])
    assert torch.equal(losses.same_texts(*columns), want)
    on_meta = [{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in c.items()} for c in columns]
    assert losses.same_texts(*on_meta).shape == (5,)  # no host read: it would raise on meta
