"""patch / undo, the boundary guard, and what a patched model does with ordinary inputs."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DataCollatorWithFlattening

from padfree_plugins import (
    BackendUnavailableError,
    BoundaryError,
    ConfigError,
    PadfreeError,
    UnsupportedArchitectureError,
    assemble,
    patch_of,
    plan,
)
from padfree_plugins.modeling import unpad
from padfree_plugins.modeling.attention import PACKED_CALL
from padfree_plugins.modeling.attention.ulysses import SequenceGroup
from padfree_plugins.modeling.sequence_parallel import SequenceParallelPatch, SplitMixer, WholeRowMixer
from padfree_plugins.packing.padded import pad_examples
from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY
from padfree_plugins.testing import assert_packed_matches_alone, example_batch
from padfree_plugins.testing.undo import assert_state_restored, model_state
from tests.conftest import make_examples, tiny_config, tiny_model
from tests.tasks_common import per_example_case
from tests.ties import assert_same_greedy, greedy


def padded(examples, side="right"):
    return pad_examples(examples, pad_token_id=1, side=side)


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_packed_row_without_boundaries_raises(model_type):
    model = tiny_model(model_type)
    examples = make_examples([4, 6])
    flattened = DataCollatorWithFlattening(return_position_ids=True)(examples)
    assembly = assemble(model, {"task": "hidden_states"})
    try:
        with pytest.raises(BoundaryError, match="restart inside a row"):
            model(input_ids=flattened["input_ids"], position_ids=flattened["position_ids"])
        # an all-ones attention_mask hides the packing from transformers, not from the guard
        with pytest.raises(BoundaryError):
            model(input_ids=flattened["input_ids"], position_ids=flattened["position_ids"],
                  attention_mask=torch.ones_like(flattened["input_ids"]))
    finally:
        assembly.undo()


def test_packed_batch_misuse_raises():
    model = tiny_model("llama")
    assembly = assemble(model, {"task": "hidden_states"})
    try:
        batch = assembly.collator(make_examples([3, 5]))
        with pytest.raises(BoundaryError, match="attention_mask"):
            model(**batch.model_inputs(), attention_mask=torch.ones_like(batch["input_ids"]))
        inputs = batch.model_inputs()
        inputs.pop("position_ids")
        with pytest.raises(BoundaryError, match="position_ids"):
            model(**inputs)
        two_rows = batch.model_inputs()
        two_rows["input_ids"] = two_rows["input_ids"].repeat(2, 1)
        two_rows["position_ids"] = two_rows["position_ids"].repeat(2, 1)
        with pytest.raises(BoundaryError, match="one row"):
            model(**two_rows)
        for cu, message in (([0, 3, 8], "must be a 1-D integer tensor"),
                            (torch.tensor([0.0, 3.0, 8.0]), "must be a 1-D integer tensor"),
                            (torch.tensor([0, 4, 8], dtype=torch.int32), r"position_ids restart at \[0, 3, 8\]"),
                            (torch.tensor([0, 3, 7], dtype=torch.int32), r"\(T=8\)")):
            with pytest.raises(BoundaryError, match=message):  # hand-built boundaries that disagree with the row
                model(**{**batch.model_inputs(), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu})
    finally:
        assembly.undo()


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_packed_batch_with_flat_tensors_is_a_clear_error(model_type):
    """``[T]`` tensors instead of ``[1, T]`` (``batch["position_ids"][0]``, a row taken out of the batch) are named,
    instead of a shape error deep in the rotary or position embeddings."""
    model = tiny_model(model_type)
    assembly = assemble(model, {"task": "hidden_states"})
    try:
        batch = assembly.collator(make_examples([3, 5]))
        for key in ("position_ids", "input_ids"):
            with pytest.raises(BoundaryError, match=rf"{key} of shape \(8,\); a packed batch is one row \[1, T\]"):
                model(**{**batch.model_inputs(), key: batch[key][0]})
    finally:
        assembly.undo()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("model_type,overrides", [("llama", dict(num_key_value_heads=2)),
                                                   ("mistral", dict(sliding_window=3)), ("bert", {})])
def test_patched_model_gives_original_results_on_padded_batch(model_type, overrides, side):
    model = tiny_model(model_type, **overrides)
    inputs = padded(make_examples([2, 9, 5]), side)
    with torch.no_grad():
        before = model(**inputs).last_hidden_state
        assembly = assemble(model, {"task": "hidden_states"})
        after = model(**inputs).last_hidden_state
        single = model(input_ids=inputs["input_ids"][1:2]).last_hidden_state  # no mask, no boundaries
        assembly.undo()
        single_before = model(input_ids=inputs["input_ids"][1:2]).last_hidden_state
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(after[real], before[real], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(single, single_before, atol=1e-6, rtol=1e-5)


def test_generate_works_and_matches_unpatched():
    model = tiny_model("llama", head="causal_lm", num_key_value_heads=2)
    inputs = padded(make_examples([3, 7]), side="left")
    kwargs = dict(max_new_tokens=6, pad_token_id=1)
    before, gaps = greedy(model, **inputs, **kwargs)
    assembly = assemble(model, {"task": "causal_lm"})
    try:
        after = model.generate(**inputs, do_sample=False, **kwargs)
    finally:
        assembly.undo()
    assert_same_greedy(after, before, gaps)


def test_undo_restores_model_exactly():
    model = tiny_model("llama")
    hooks_before = dict(model.base_model._forward_pre_hooks)
    before = model_state(model)
    assembly = assemble(model, {"task": "hidden_states"})
    assert model.config._attn_implementation == "padfree_exact"
    assert all(m.config._attn_implementation == "padfree_exact" for m in model.modules() if hasattr(m, "config"))
    assert patch_of(model) is assembly.patch
    described = assembly.patch.describe()
    assert described["attn_implementation"] == "sdpa -> padfree_exact"
    assert "LlamaAttention" in described["attention_modules"]
    with pytest.raises(AssertionError, match="_padfree_patch was added"):  # the check sees a patch
        assert_state_restored(before, model)
    assembly.undo()
    assembly.undo()  # twice is harmless
    assert model.config._attn_implementation == "sdpa"
    assert dict(model.base_model._forward_pre_hooks) == hooks_before
    assert patch_of(model) is None
    assert_state_restored(before, model)


def _hybrid(model_type: str = "qwen3_5_text"):
    from tests.hybrids_common import hybrid_model, slow

    return slow(hybrid_model(model_type, initializer_range=0.1))


def _lfm2():
    from tests.test_hybrid_lfm2 import model_of

    return model_of("lfm2", initializer_range=0.1).float().eval()


def _encoder(name: str):
    from tests.tasks_common import model_for
    from tests.test_encoders import NO_DROPOUT

    return model_for(name, **NO_DROPOUT).eval()


@functools.cache
def _processor():
    from padfree_plugins.testing.vision import image_text_processor

    return image_text_processor("qwen3_5")


def _vision_language():
    pytest.importorskip("PIL")
    from padfree_plugins.testing.vision import tiny_vision_language_model

    return tiny_vision_language_model("qwen3_5", _processor())


def _examples(model) -> list[dict]:
    """Text examples for ``model`` (a vision-language model's from its processor: no id is an image token)."""
    if getattr(model.config, "image_token_id", None) is None:
        return example_batch(model)
    from padfree_plugins.testing.vision import image_text_example

    texts = ("only words here", "x", "a longer line of words and more words", "two words")
    return [image_text_example(_processor(), text) for text in texts]


def _packed_images(model, assembly):
    """A packed row of a vision-language model with images in it, forward and backward."""
    from padfree_plugins.testing.vision import image_text_example, synthetic_image

    examples = [image_text_example(_processor(), "a picture <image> of words", [synthetic_image(60, 90, 0)]),
                *_examples(model)[:2], image_text_example(_processor(), "<image>", [synthetic_image(40, 40, 1)])]
    assembly.forward(model, assembly.collator(examples)).loss.backward()


def _packed_forward(model, assembly):
    """A packed batch through the assembly's forward, with a backward where it returns a loss."""
    examples = example_batch(model, labels=assembly.plan.task.name == "seq_cls")
    outputs = assembly.forward(model, assembly.collator(examples))
    loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    if loss is not None:
        loss.backward()


def _padded_forward(model, assembly):
    """An ordinary padded call with gradients: unpad packs it inside the model."""
    inputs = padded(example_batch(model), side="right")
    model(**inputs, labels=inputs["input_ids"], use_cache=False).loss.backward()


def _shared_forward(model, assembly):
    """A row with shared prefixes (prompts once, completions continuing their states), forward and backward."""
    from tests.test_hybrid_prefixes import padded_call

    shared, _ = unpad.pack_padded_call({"input_ids": padded_call(model.config.vocab_size)[0]},
                                       *padded_call(model.config.vocab_size)[1:], False, True)
    assert shared[SHARED_PREFIXES_KEY].parents.count(-1) < len(shared[SHARED_PREFIXES_KEY].parents)
    model(**shared).logits.sum().backward()


def _checkpointed(model):
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _sequence_parallel(mixers: str):
    """Sequence parallelism over a group of 2 installed on the assembly, as ``assemble`` installs it (one process:
    no forward; tests/test_sequence_parallel_undo.py runs the forwards on 2 processes)."""
    def install(model, assembly):
        patch = SequenceParallelPatch.install(assembly.patch, SequenceGroup(None, 0, 2), mixers=mixers)
        assembly.patch.handles.append(patch)
        kind = SplitMixer if mixers == "split" else WholeRowMixer
        assert sum(isinstance(module.__dict__.get("forward"), kind) for module in model.modules()) == 2
    return install


#: Patch kind -> (model, first config, what runs on the first assembly, second config). Every kind of piece an
#: assembly installs: the attention implementation and guard, unpad's hooks, tiled MLPs and loss, the per-example
#: compute route, hybrid mixers (with gradient checkpointing's per-forward wraps), shared prefixes through them,
#: LFM2's short convolutions, sequence parallelism's split and gathered mixers.
UNDO_CASES = {
    "attention": (lambda: tiny_model("llama"), {"task": "hidden_states"}, _packed_forward,
                  {"task": "hidden_states", "unpad": "off"}),
    "unpad": (lambda: tiny_model("llama", head="causal_lm"), {"task": "causal_lm", "unpad": "always"},
              _padded_forward, {"task": "causal_lm", "unpad": "off"}),
    "tiling": (lambda: tiny_model("llama", head="causal_lm"), {"task": "causal_lm", "memory": {"tile_tokens": 4}},
               _packed_forward, {"task": "causal_lm"}),
    # problem_type set beforehand: transformers' classification loss sets it on the first labelled call, patched or not
    "compute route": (lambda: tiny_model("llama", head="seq_cls", num_labels=3,
                                         problem_type="single_label_classification"), {"task": "seq_cls"},
                      _packed_forward, {"task": "seq_cls", "attention": "exact", "unpad": "off"}),
    "hybrid mixers": (lambda: _checkpointed(_hybrid()), {"task": "causal_lm", "mixers": "exact"}, _packed_forward,
                      {"task": "causal_lm"}),
    "shared prefixes": (_hybrid, {"task": "causal_lm", "prefix_sharing": "on"}, _shared_forward,
                        {"task": "causal_lm", "prefix_sharing": "off"}),
    "short convolutions": (_lfm2, {"task": "causal_lm"}, _packed_forward, {"task": "causal_lm", "unpad": "off"}),
    "own attention (DeBERTa-v2)": (lambda: _encoder("deberta-v2"), {"task": "hidden_states"}, _packed_forward,
                                   {"task": "hidden_states", "unpad": "off"}),
    "token dropout (ESM)": (lambda: _encoder("esm"), {"task": "hidden_states"}, _packed_forward,
                            {"task": "hidden_states", "attention": "exact"}),
    "pooled encoder": (lambda: _encoder("bert"), {"task": "embedding"}, _packed_forward, {"task": "hidden_states"}),
    "vision towers and mixers": (_vision_language, {"task": "causal_lm"}, _packed_images,
                                 {"task": "causal_lm", "mixers": "exact"}),
    "sequence parallel split": (_hybrid, {"task": "causal_lm", "attention": "exact"}, _sequence_parallel("split"),
                                {"task": "causal_lm"}),
    "sequence parallel gather": (_hybrid, {"task": "causal_lm", "attention": "exact"}, _sequence_parallel("gather"),
                                 {"task": "causal_lm", "mixers": "exact"}),
}


@pytest.mark.parametrize("kind", UNDO_CASES)
def test_undo_leaves_every_module_as_before_and_a_second_assembly_is_exact(kind):
    """After ``undo`` every module's ``__dict__`` (an instance ``forward``, hooks, attributes), every config and the
    packed-call markers are as before the assembly, the model's own padded call gives the same outputs bit for bit,
    and the model assembled again with another config equals every example run alone (and undoes as cleanly)."""
    build, first, run, second = UNDO_CASES[kind]
    model = build()
    inputs = padded(_examples(model), side="right")
    with torch.no_grad():
        want = model(**inputs, use_cache=False)[0]
    before = model_state(model)
    assembly = assemble(model, first)
    run(model, assembly)
    model.zero_grad(set_to_none=True)
    assembly.undo()
    assert_state_restored(before, model)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs, use_cache=False)[0], want, rtol=0, atol=0)
    model.eval()
    model.gradient_checkpointing_disable() if model.is_gradient_checkpointing else None
    again = model_state(model)
    report = assert_packed_matches_alone(model, second, _examples(model), atol=1e-5, grad_atol=1e-4)
    assert report.max_output_diff <= 1e-5
    assert_state_restored(again, model)


def test_the_state_check_names_every_kind_of_leftover():
    """A forward hook, an instance forward, a config value and a packed-call marker left behind are each named; with
    them gone the check passes."""
    model = tiny_model("llama")
    before = model_state(model)
    handle = model.layers[0].register_forward_hook(lambda *args: None)
    model.norm.forward = model.norm.forward
    model.config.use_cache = not model.config.use_cache
    token = PACKED_CALL.set(True)
    try:
        with pytest.raises(AssertionError) as info:
            assert_state_restored(before, model)
    finally:
        PACKED_CALL.reset(token)
        handle.remove()
        del model.norm.forward
        model.config.use_cache = not model.config.use_cache
    message = str(info.value)
    assert "undo left 4 difference(s)" in message, message
    for leftover in ("module layers.0: _forward_hooks is OrderedDict of 1", "module norm: forward was added",
                     "config model.config: use_cache is", "PACKED_CALL is True, was False"):
        assert leftover in message, message
    assert_state_restored(before, model)


def test_undo_takes_pieces_off_last_installed_first():
    """Sequence parallelism wraps the mixers' packed forwards; undo takes it off first, then the mixers' own patch,
    so that the model's own forwards come back (taken off in installation order, the split mixers' removal would put
    the packed forwards back after the mixers' patch had removed them: the fault a second assembly tripped on)."""
    model = _hybrid()
    before = model_state(model)
    assembly = assemble(model, {"task": "causal_lm", "attention": "exact"})
    _sequence_parallel("split")(model, assembly)
    for handle in list(assembly.patch.handles):  # the old order: first installed first
        handle.remove()
    with pytest.raises(AssertionError, match=r"linear_attn: forward was added \(PackedMixer\)"):
        assert_state_restored(before, model)


def test_double_patch_is_refused():
    model = tiny_model("llama")
    assembly = assemble(model, {"task": "hidden_states"})
    try:
        with pytest.raises(PadfreeError, match="already patched"):
            assemble(model, {"task": "hidden_states"})
    finally:
        assembly.undo()


def test_peft_model_is_unwrapped_and_equivalent():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", num_key_value_heads=2)
    lora_config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, lora_config)
    examples = make_examples([5, 1, 11])
    with torch.no_grad():
        reference = [lora(input_ids=torch.tensor([ex["input_ids"]])).last_hidden_state[0] for ex in examples]
    assembly = assemble(lora, {"task": "hidden_states"})
    try:
        assert assembly.model is model
        batch = assembly.collator(examples)
        with torch.no_grad():
            packed = lora(**batch.model_inputs()).last_hidden_state[0]
    finally:
        assembly.undo()
    cu = batch["cu_seq_lens_q"].tolist()
    for i, want in enumerate(reference):
        torch.testing.assert_close(packed[cu[i] : cu[i + 1]], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("adapter", ["PromptTuningConfig", "PrefixTuningConfig", "PromptEncoderConfig"])
def test_peft_prompt_learning_is_refused_before_patching(adapter):
    """Virtual tokens / prefixes are added once per row: the packed examples would share them."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_model("llama", head="causal_lm", num_key_value_heads=2),
                               getattr(peft, adapter)(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(UnsupportedArchitectureError, match="prompt learning"):
        assemble(lora, {"task": "causal_lm"})
    assert lora.get_base_model().config._attn_implementation == "sdpa"  # nothing patched


def test_unsupported_architecture_says_what_is_supported():
    model = tiny_model("gpt2", n_embd=64, n_layer=2, n_head=4)
    with pytest.raises(UnsupportedArchitectureError) as info:
        assemble(model, {"task": "hidden_states"})
    message = str(info.value)
    assert "'gpt2'" in message and "llama" in message and "bert" in message and "writing-a-plugin" in message


def test_model_without_attention_interface_is_refused(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(type(model), "set_attn_implementation", lambda self, name: None)
    with pytest.raises(UnsupportedArchitectureError, match="AttentionInterface"):
        assemble(model, {"task": "hidden_states"})
    assert patch_of(model) is None


def test_backend_selection_and_errors():
    config = tiny_config("llama")
    assert plan(config, {"attention": "auto"}, device_type="cpu").backend.name == "exact"
    with pytest.raises(BackendUnavailableError, match="'varlen' was requested"):
        plan(config, {"attention": "varlen"}, device_type="cpu")
    with pytest.raises(BackendUnavailableError, match="flash_attn"):
        plan(config, {"attention": "flash_attn"}, device_type="cpu")
    with pytest.raises(ConfigError, match="Did you mean 'flash_attn'"):
        plan(config, {"attention": "flsh_attn"})
    with pytest.raises(ConfigError, match="Did you mean 'causal_lm'"):
        plan(config, {"task": "causal_llm"})
    with pytest.raises(ConfigError, match="architecture 'lama'"):
        plan(config, {"architecture": "lama"})


def test_forced_backend_missing_feature_is_an_error():
    """A backend that cannot implement a feature the model uses is refused, naming the feature."""
    from padfree_plugins import AttentionBackend, PluginHost, hookimpl
    from padfree_plugins.modeling.attention.backends import exact_varlen

    class NoWindowPlugin:
        @hookimpl
        def register_attention_backends(self):
            return [AttentionBackend("nowindow", exact_varlen, features=frozenset({"causal", "gqa"}))]

    host = PluginHost({"nowindow": NoWindowPlugin()})
    config = tiny_config("mistral", sliding_window=8, num_key_value_heads=2)
    with pytest.raises(BackendUnavailableError, match="sliding_window"):
        plan(config, {"attention": "nowindow"}, host=host, device_type="cpu")
    assert plan(config, {"attention": "auto"}, host=host, device_type="cpu").backend.name == "exact"


def test_layer_dropping_boundaries_raises_instead_of_mixing():
    """StableLM's decoder layer does not pass **kwargs to attention: declaring it is not enough, and the packed
    forward must raise rather than attend across examples."""
    from padfree_plugins import Architecture, PluginHost, hookimpl
    from padfree_plugins.modeling.attention import PACKED_CALL

    class StableLmDeclaration:
        @hookimpl
        def register_architectures(self):
            return [Architecture("stablelm", ("stablelm",), "decoder")]

    model = tiny_model("stablelm")
    assembly = assemble(model, {"task": "hidden_states"}, host=PluginHost({"stablelm-naive": StableLmDeclaration()}))
    try:
        batch = assembly.collator(make_examples([3, 4]))
        with pytest.raises(BoundaryError, match="does not pass \\*\\*kwargs"):
            model(**batch.model_inputs())
        assert PACKED_CALL.get() is False  # reset although the forward raised
        with pytest.raises(BoundaryError, match="restart inside a row"):
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        assert PACKED_CALL.get() is False
        model(input_ids=torch.tensor([[5, 6, 7]]))  # ordinary calls still work
    finally:
        assembly.undo()


def test_attention_dropout_policy():
    """attention_dropout: keep respects the model's attention dropout (so a backend without dropout is not chosen
    by auto, with a note); disable turns it off, which lets that backend run."""
    from padfree_plugins import AttentionBackend, PluginHost, hookimpl
    from padfree_plugins.modeling.attention.backends import exact_varlen

    class NoDropoutBackend:
        @hookimpl
        def register_attention_backends(self):
            return [AttentionBackend("nodrop", exact_varlen, speed_rank=50,
                                     features=frozenset({"causal", "bidirectional", "gqa"}))]

    host = PluginHost({"nodrop": NoDropoutBackend()})
    config = tiny_config("bert", attention_probs_dropout_prob=0.5)
    kept = plan(config, {"task": "hidden_states"}, host=host, device_type="cpu")
    assert kept.backend.name == "exact" and "dropout" in kept.features
    assert any("attention_dropout: disable" in note for note in kept.notes)
    dropped = plan(config, {"task": "hidden_states", "attention_dropout": "disable"}, host=host, device_type="cpu")
    assert dropped.backend.name == "nodrop"

    model = tiny_model("bert", attention_probs_dropout_prob=0.5, hidden_dropout_prob=0.0)
    batch_examples = make_examples([6, 9])
    with torch.no_grad():
        reference, batch, _ = _packed(model, batch_examples, {"task": "hidden_states"})
        model.train()
        torch.manual_seed(1)
        kept_out, _, _ = _packed(model, batch_examples, {"task": "hidden_states"})
        disabled_out, _, assembly = _packed(model, batch_examples, {"task": "hidden_states",
                                                                    "attention_dropout": "disable"})
    assert "nodropout" in assembly.patch.implementation
    assert not torch.allclose(kept_out, reference)
    torch.testing.assert_close(disabled_out, reference)


def _packed(model, examples, config):
    assembly = assemble(model, config)
    try:
        batch = assembly.collator(examples)
        return model(**batch.model_inputs()).last_hidden_state, batch, assembly
    finally:
        assembly.undo()


@pytest.mark.parametrize("model_type,task", [("bert", "hidden_states"), ("roberta", "seq_cls"),
                                             ("llama", "causal_lm")])
def test_example_longer_than_the_model_takes_is_a_clear_error(model_type, task):
    """Every task refuses an example longer than the model's position table, naming the limit (instead of an
    index error inside the position embeddings, or silent extrapolation)."""
    from padfree_plugins import BatchError

    head = {"seq_cls": "seq_cls", "causal_lm": "causal_lm"}.get(task, "base")
    model = tiny_model(model_type, head=head)  # max_position_embeddings=256
    limit = 256 - (model.config.pad_token_id + 1 if model_type == "roberta" else 0)
    assembly = assemble(model, {"task": task})
    try:
        with pytest.raises(BatchError, match=f"at most {limit} .*max_position_embeddings=256"):
            assembly.collator(make_examples([5, limit + 1]))
        assembly.collator(make_examples([5, limit]))  # the longest that fits
    finally:
        assembly.undo()
    with pytest.raises(ConfigError, match="more than the model takes"):
        assemble(model, {"task": task, "max_length": limit + 1})
    assert patch_of(model) is None


def test_auto_falls_back_to_exact_for_inputs_the_backend_cannot_take():
    """With attention: auto, a backend limited to some dtypes runs what it can and exact runs the rest; named
    explicitly, the same backend gets no fallback."""
    from padfree_plugins import AttentionBackend, PluginHost, hookimpl
    from padfree_plugins.modeling.attention.backends import exact_varlen

    calls = []

    def half_only(*args, **kwargs):
        calls.append(args[0].dtype)
        return exact_varlen(*args, **kwargs)

    class HalfOnly:
        @hookimpl
        def register_attention_backends(self):
            return [AttentionBackend("halfonly", half_only, speed_rank=50, dtypes=("bfloat16",))]

    host = PluginHost({"halfonly": HalfOnly()})
    model = tiny_model("llama", num_key_value_heads=2)
    examples = make_examples([4, 7])
    assembly = assemble(model, {"task": "hidden_states"}, host=host)
    try:
        assert (assembly.plan.backend.name, assembly.plan.fallback.name) == ("halfonly", "exact")
        batch = assembly.collator(examples)
        with torch.no_grad():
            model(**batch.model_inputs())  # fp32: exact
            assert calls == []
            model.to(torch.bfloat16)(**batch.model_inputs())
        assert calls and set(calls) == {torch.bfloat16}
    finally:
        assembly.undo()
        model.float()
    assert plan(model.config, {"attention": "halfonly"}, host=host, device_type="cpu").fallback is None


def test_torch_compile_keeps_the_packed_result_and_the_guard():
    """``torch.compile`` (what ``TrainingArguments(torch_compile=True)`` does) on a patched model: same loss and
    gradients as eager for packed rows of changing size, and the guard still refuses rows without boundaries.
    ``aot_eager`` traces forward and backward like inductor, without its C++ compile time."""
    model = tiny_model("llama", head="causal_lm").train()
    assembly = assemble(model, {"task": "causal_lm"})
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    try:
        for lengths in ([5, 9, 3], [12, 4]):
            batch = assembly.collator(make_examples(lengths))
            results = []
            for runner in (model, compiled):
                model.zero_grad(set_to_none=True)
                loss = assembly.forward(runner, batch).loss
                loss.backward()
                results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
            for got, want in zip(results[1][1], results[0][1]):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        flattened = DataCollatorWithFlattening(return_position_ids=True)(make_examples([4, 6]))
        with pytest.raises(BoundaryError, match="restart inside a row"):
            compiled(input_ids=flattened["input_ids"], position_ids=flattened["position_ids"])
    finally:
        assembly.undo()


@pytest.mark.parametrize("task", ["seq_cls", "embedding"])
def test_torch_compile_runs_the_per_example_tasks(task):
    """The per-example heads run as the compiled model's forward (the compute route), equal to eager."""
    head = "seq_cls" if task == "seq_cls" else "base"
    model = tiny_model("bert", head=head, num_labels=2)  # eval: no dropout, so eager and compiled agree
    config, examples = per_example_case(task, [3, 7, 2])
    assembly = assemble(model, config)
    try:
        batch = assembly.collator(examples)
        compiled = torch.compile(model, backend="aot_eager")
        results = []
        for runner in (model, compiled):
            model.zero_grad(set_to_none=True)
            loss = assembly.forward(runner, batch).loss
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
        assert len(results[1][1]) == len(results[0][1]) > 0
        for got, want in zip(results[1][1], results[0][1]):  # compiled: one masked call per row, another sum order
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    finally:
        assembly.undo()


def _repad_on_cpu():
    """The builtin ``repad`` backend, registered for the CPU under another name (it is an accelerator fallback)."""
    import dataclasses

    from padfree_plugins import PluginHost, hookimpl

    spec = PluginHost().backends()["repad"][0]

    class RepadOnCPU:
        @hookimpl
        def register_attention_backends(self):
            return [dataclasses.replace(spec, name="repad_cpu", devices=("cpu",))]

    return PluginHost({"repad_cpu": RepadOnCPU()})


@pytest.mark.parametrize("model_type,overrides", [("llama", {"num_key_value_heads": 2}),
                                                  ("mistral", {"sliding_window": 4}), ("bert", {})])
def test_repad_backend_equals_exact_through_the_model(model_type, overrides):
    """Outputs and gradients of a patched model with ``repad`` equal those with ``exact``."""
    host = _repad_on_cpu()
    model = tiny_model(model_type, **overrides)
    batch = None
    results = {}
    for backend in ("exact", "repad_cpu"):
        assembly = assemble(model, {"task": "hidden_states", "attention": backend}, host=host)
        try:
            batch = batch or assembly.collator(make_examples([1, 6, 9, 3]))
            model.zero_grad(set_to_none=True)
            hidden = model(**batch.model_inputs()).last_hidden_state
            (hidden * torch.linspace(-1, 1, hidden.shape[-1])).sum().backward()
            results[backend] = (hidden.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
        finally:
            assembly.undo()
    torch.testing.assert_close(results["repad_cpu"][0], results["exact"][0], atol=1e-5, rtol=1e-5)
    for got, want in zip(results["repad_cpu"][1], results["exact"][1]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_auto_fallback_is_the_fastest_backend_that_takes_every_dtype():
    """On a GPU the fallback for what a 16-bit-only kernel cannot take (fp32) is ``repad`` (a fixed number of
    kernels, no host sync); on a CPU it is ``exact``; a backend that takes every dtype needs none."""
    from padfree_plugins import AttentionBackend, PluginHost, hookimpl
    from padfree_plugins.modeling.attention.backends import exact_varlen

    class HalfOnly:
        @hookimpl
        def register_attention_backends(self):
            return [AttentionBackend("halfonly", exact_varlen, speed_rank=50, devices=("cpu", "cuda"),
                                     dtypes=("bfloat16",))]

    host = PluginHost({"halfonly": HalfOnly()})
    config = tiny_config("llama")
    on_gpu = plan(config, {"attention": "auto"}, host=host, device_type="cuda")
    assert (on_gpu.backend.name, on_gpu.fallback.name) == ("halfonly", "repad")
    on_cpu = plan(config, {"attention": "auto"}, host=host, device_type="cpu")
    assert (on_cpu.backend.name, on_cpu.fallback.name) == ("halfonly", "exact")
    if not torch.cuda.is_available():  # without varlen / flash-attn, repad is the best a GPU gets, for every dtype
        plain = plan(config, {"attention": "auto"}, device_type="cuda")
        assert (plain.backend.name, plain.fallback) == ("repad", None)
