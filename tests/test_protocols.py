"""The plugin contract in padfree_plugins.contract.protocols: every builtin answer has its hook's shape, and the
framework reads no optional attribute of a hook's answer that the protocols do not declare."""

import re
from pathlib import Path

import pytest
from conftest import tiny_model

from padfree_plugins import assemble
from padfree_plugins.contract import protocols

ROOT = Path(__file__).resolve().parents[1]
#: ``getattr(<something>collator|forward|packing, "name"`` in the framework's own code.
OPTIONAL_READ = re.compile(r"getattr\(([\w.]*(?:collator|forward|packing))\s*,\s*\"(\w+)\"")
#: Read on the trainer's own collator (transformers' ``DataCollatorForLanguageModeling``) or on the trainer plugins'
#: own wrappers (``TrainerCollator.labelled_logits``, ``ExampleByExample.processing``), not on a hook's answer.
TRAINER_COLLATOR_READS = {("padfree_plugins/integrations/checks.py", "mlm"),
                          ("padfree_plugins/integrations/checks.py", "tokenizer"),
                          ("padfree_plugins/integrations/checks.py", "processing"),
                          ("padfree_plugins/integrations/base.py", "labelled_logits")}


def test_every_optional_attribute_read_is_declared():
    declared = {name for names in protocols.OPTIONAL_ATTRIBUTES.values() for name in names}
    sources = [path for path in (ROOT / "padfree_plugins").rglob("*.py") if "testing" not in path.parts]
    reads = {(path.relative_to(ROOT).as_posix(), match.group(2)) for path in sources
             for match in OPTIONAL_READ.finditer(path.read_text())}
    assert len(reads) >= 10, "the scan found too few reads to mean anything"
    undeclared = sorted((path, name) for path, name in reads - TRAINER_COLLATOR_READS if name not in declared)
    assert not undeclared, f"read on a hook's answer but declared in no protocol: {undeclared}"


def test_the_scan_would_see_an_undeclared_read():
    assert OPTIONAL_READ.findall('x = getattr(self.assembly.collator, "brand_new", None)') == [
        ("self.assembly.collator", "brand_new")]


@pytest.mark.parametrize("task,model_type", [("causal_lm", "llama"), ("hidden_states", "bert"), ("seq_cls", "bert"),
                                             ("reranker", "bert"), ("embedding", "bert")])
def test_builtin_answers_have_their_hooks_shapes(task, model_type):
    head = {"causal_lm": "causal_lm", "seq_cls": "seq_cls", "reranker": "seq_cls"}.get(task, "base")
    model = tiny_model(model_type, head)
    config = {"task": task}
    if task == "reranker":
        model.config.num_labels = 1
    assembly = assemble(model, config)
    try:
        assert isinstance(assembly.collator, protocols.Collator)
        assert isinstance(assembly.forward, protocols.TaskForward)
        assert isinstance(assembly.reverter, protocols.Reverter)
        assert isinstance(assembly.patch, protocols.ModelPatchLike)
        assert assembly.pooler is None or isinstance(assembly.pooler, protocols.Pooler)
    finally:
        assembly.undo()
