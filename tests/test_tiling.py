"""Tiled MLP and tiled LM head + loss (``memory.tile_tokens``): the same loss and every gradient as untiled, for dense,
MoE, hybrid and gpt-oss decoders, with gradient checkpointing and LoRA, through the plain loop and HF Trainer; a
deliberate fault (a tile that drops its last token, a loss normalised per tile) fails the comparison; tiled saved
activations are smaller; bad input is refused with nothing changed."""

from __future__ import annotations

import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from padfree_plugins import ConfigError, UnsupportedArchitectureError, assemble, patch_of, plan
from padfree_plugins.config.schema import load_config
from padfree_plugins.modeling.tiling import MLPTiling, TiledCall, auto_tiles, head_loss, spans, tiled_modules
from padfree_plugins.packing.labelled_logits import keep_labelled_logits
from padfree_plugins.testing import faults
from tests.conftest import make_examples, tiny_config
from tests.hybrids_common import HYBRIDS

#: Examples of a row of 150 tokens: tiles of 16 cut inside examples and between them, the last tile short.
LENGTHS = [1, 37, 9, 60, 2, 41]
TILE = 16
#: A Llama-shaped tiny model with the MLP wider than the hidden size, as in Llama-8B (3.5x).
LLAMA = dict(intermediate_size=224, num_key_value_heads=2)
ARCHITECTURES = {
    "llama": ("llama", LLAMA),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    output_router_logits=True, router_aux_loss_coef=0.1)),
    "qwen3_5_text": ("qwen3_5_text", HYBRIDS["qwen3_5_text"]),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", HYBRIDS["qwen3_5_moe_text"]),
    "gpt_oss": ("gpt_oss", dict(num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4,
                                num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                                output_router_logits=True, router_aux_loss_coef=0.1)),
}


def causal_lm(name: str, seed: int = 0, checkpointing: bool = False):
    model_type, overrides = ARCHITECTURES[name]
    torch.manual_seed(seed)
    attention = "eager" if model_type == "gpt_oss" else "sdpa"
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), attn_implementation=attention)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.float().train()


def loss_and_grads(model, memory=None, lengths=LENGTHS, fault=None, num_items=None):
    """The loss and every gradient of one packed step through ``assembly.forward`` (labelled logits, as HF Trainer's
    loss call), with ``memory`` as the config's memory section; ``num_items``: ``num_items_in_batch`` as a multiple
    of the batch's labels (gradient accumulation)."""
    config = {"task": "causal_lm", **({"memory": memory} if memory else {})}
    assembly = assemble(model, config)
    try:
        batch = keep_labelled_logits(assembly.collator(make_examples(lengths, seed=3)))
        model.zero_grad(set_to_none=True)
        with fault() if fault else _nothing():
            kwargs = {} if num_items is None else {"num_items_in_batch": batch["shift_labels"].numel() * num_items}
            outputs = assembly.forward(model, batch, **kwargs)
            outputs.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return outputs.loss.detach(), grads
    finally:
        assembly.undo()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_same(got, want, atol_loss=1e-5, atol_grad=1e-4):
    torch.testing.assert_close(got[0], want[0], atol=atol_loss, rtol=atol_loss)
    assert got[1].keys() == want[1].keys() and len(want[1]) > 5
    for key, grad in want[1].items():
        torch.testing.assert_close(got[1][key], grad, atol=atol_grad, rtol=atol_grad, msg=lambda m: f"{key}: {m}")


TILED = {"tile_tokens": TILE}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_tiled_mlp_and_loss_give_the_untiled_loss_and_gradients(name):
    want = loss_and_grads(causal_lm(name))
    got = loss_and_grads(causal_lm(name), TILED)
    assert_same(got, want)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_tiling_with_gradient_checkpointing_gives_the_untiled_loss_and_gradients(name):
    want = loss_and_grads(causal_lm(name))
    got = loss_and_grads(causal_lm(name, checkpointing=True), TILED)
    assert_same(got, want)


@pytest.mark.parametrize("part", ["mlp", "loss"])
def test_each_part_alone_gives_the_untiled_loss_and_gradients(part):
    want = loss_and_grads(causal_lm("llama"))
    got = loss_and_grads(causal_lm("llama"), {**TILED, "tile_mlp": part == "mlp", "tile_loss": part == "loss"})
    assert_same(got, want)


def test_the_moe_router_and_its_aux_loss_run_untiled():
    """Only the routed experts (and shared experts) are tiled: router logits, hence the load-balancing loss, are
    computed once for the whole row."""
    model = causal_lm("qwen3_5_moe_text")
    kinds = {type(m).__name__ for m in tiled_modules(model)}
    assert kinds == {"Qwen3_5MoeExperts", "Qwen3_5MoeMLP"}  # routed experts and the shared expert
    assert not any("Router" in kind or "Gate" in kind for kind in kinds)


@pytest.mark.parametrize("fault", ["tile_drops_last_token", "loss_normalised_per_tile"])
def test_a_tiling_fault_fails_the_comparison(fault):
    want = loss_and_grads(causal_lm("llama"), num_items=3)
    assert_same(loss_and_grads(causal_lm("llama"), TILED, num_items=3), want)
    got = loss_and_grads(causal_lm("llama"), TILED, fault=getattr(faults, fault), num_items=3)
    with pytest.raises(AssertionError):
        assert_same(got, want)


def test_lora_adapters_in_the_mlp_get_the_untiled_gradients():
    peft = pytest.importorskip("peft")

    def lora():
        return peft.get_peft_model(causal_lm("llama"), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]))

    want, got = loss_and_grads(lora()), loss_and_grads(lora(), TILED)
    assert any("lora" in key and "mlp" in key for key in want[1])
    assert_same(got, want)


def test_dropout_inside_a_tile_is_replayed_exactly_in_the_recompute():
    """A tile recomputed in the backward draws the same dropout mask as in the forward: the gradients equal those
    of the tiles run once with autograd, under the same seed."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 8))
    x = torch.randn(1, 50, 8, requires_grad=True)
    weight = torch.randn(1, 50, 8)

    def grads(tiled):
        mlp.zero_grad()
        x.grad = None
        torch.manual_seed(7)
        if tiled:
            out = TiledCall.apply(mlp, mlp, spans(50, 16), 1, x, *mlp.parameters())
        else:
            out = torch.cat([mlp(x[:, s:s + 16]) for s in range(0, 50, 16)], dim=1)
        (out * weight).sum().backward()
        return [x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())]

    for got, want in zip(grads(True), grads(False)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_head_loss_normalises_like_transformers():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=True)
    hidden = torch.randn(23, 16, requires_grad=True)
    labels = torch.randint(0, 40, (23,))
    labels[[0, 5, 6]] = -100
    for num_items in (None, torch.tensor(31)):
        logits = head(hidden).float()
        want = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100,
                                                 reduction="mean" if num_items is None else "sum")
        want = want if num_items is None else want / num_items
        got = head_loss(hidden, head, labels, num_items, tile=5)
        torch.testing.assert_close(got, want)
        for g, w in zip(torch.autograd.grad(got, [hidden, head.weight, head.bias]),
                        torch.autograd.grad(want, [hidden, head.weight, head.bias])):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    nothing = head_loss(hidden[:0], head, labels[:0], torch.tensor(31), tile=5)  # a micro-batch without labels
    assert nothing.item() == 0 and torch.autograd.grad(nothing, head.weight)[0].abs().max() == 0


# -- memory -----------------------------------------------------------------------------------------------------


class SavedBytes:
    """The peak of the bytes autograd holds saved for the backward (activations; parameters not counted), from
    ``saved_tensors_hooks``: each saved tensor counted once while any reference to it lives."""

    def __init__(self):
        self.live, self.peak, self.counts = 0, 0, {}

    def _release(self, key, size):
        self.counts[key] -= 1
        if not self.counts[key]:
            del self.counts[key]
            self.live -= size

    def pack(self, tensor):
        if isinstance(tensor, torch.nn.Parameter) or tensor.numel() == 0:
            return tensor
        key, size = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in self.counts:
            self.counts[key] = 0
            self.live += size
            self.peak = max(self.peak, self.live)
        self.counts[key] += 1
        holder = _Held(tensor)
        weakref.finalize(holder, self._release, key, size)
        return holder

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


class _Held:
    def __init__(self, tensor):
        self.tensor = tensor


def peak_saved_bytes(memory):
    model = causal_lm("llama")
    model.config.vocab_size  # noqa: B018  (the tiny vocabulary: 128)
    assembly = assemble(model, {"task": "causal_lm", **({"memory": memory} if memory else {})})
    try:
        generator = torch.Generator().manual_seed(0)
        examples = [{"input_ids": torch.randint(5, 128, (n,), generator=generator).tolist()} for n in (250,) * 16]
        batch = keep_labelled_logits(assembly.collator(examples))
        counter = SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            assembly.forward(model, batch).loss.backward()
        return counter.peak
    finally:
        assembly.undo()


def test_tiled_peak_saved_activations_are_smaller_for_a_row_of_4k_tokens():
    untiled = peak_saved_bytes(None)
    tiled = peak_saved_bytes({"tile_tokens": 256})
    assert untiled > 0 and tiled < 0.8 * untiled, (tiled, untiled)


# -- configuration and refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -4])
def test_tiles_under_one_token_are_refused(value):
    with pytest.raises(ConfigError, match="at least 1 token"):
        load_config({"memory": {"tile_tokens": value}})


def test_tile_tokens_must_be_a_number_or_auto():
    with pytest.raises(ConfigError, match="tile_tokens"):
        load_config({"memory": {"tile_tokens": "big"}})


class ConvMLP(torch.nn.Module):
    """A feed-forward that mixes neighbouring tokens: not token-local."""

    def __init__(self, width):
        super().__init__()
        self.conv = torch.nn.Conv1d(width, width, 3, padding=1)

    def forward(self, hidden):
        return self.conv(hidden.transpose(1, 2)).transpose(1, 2)


def test_a_feed_forward_that_is_not_token_local_is_refused_naming_it_with_nothing_changed():
    model = causal_lm("llama")
    model.model.layers[1].mlp = ConvMLP(model.config.hidden_size)
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 1 \(ConvMLP\).*Conv1d.*tile_mlp: false"):
        assemble(model, {"task": "causal_lm", "memory": {"tile_tokens": 8}})
    assert patch_of(model) is None and model.config._attn_implementation == before
    assert not any("forward" in m.__dict__ for m in model.modules())
    assemble(model, {"task": "causal_lm", "memory": {"tile_tokens": 8, "tile_mlp": False}}).undo()


def test_a_model_that_scales_its_logits_is_refused_for_the_tiled_loss():
    model = AutoModelForCausalLM.from_config(tiny_config("gemma2", head_dim=16, final_logit_softcapping=30.0))
    with pytest.raises(UnsupportedArchitectureError, match="final_logit_softcapping.*tile_loss: false"):
        assemble(model, {"task": "causal_lm", "memory": {"tile_tokens": 8}})
    assert patch_of(model) is None


def test_undo_removes_the_tiles():
    model = causal_lm("llama")
    assembly = assemble(model, {"task": "causal_lm", "memory": {"tile_tokens": 8}})
    assert all("forward" in layer.mlp.__dict__ for layer in model.model.layers)
    assembly.undo()
    assert not any("forward" in m.__dict__ for m in model.modules())
    with pytest.raises(UnsupportedArchitectureError, match="already replaced"):
        tiling = MLPTiling.install(model, 8)
        MLPTiling.install(model, 8)
    tiling.remove()


def test_auto_picks_tiles_from_the_model_sizes_and_check_shows_them():
    config = tiny_config("llama", hidden_size=4096, vocab_size=128256, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336)
    assert auto_tiles(config) == (4096, 448)  # 448 x 128,256 logits <= 4096 x 14,336 intermediate
    small = tiny_config("llama")  # hidden 64, intermediate 128, vocabulary 128
    assert auto_tiles(small) == (1024, 1024)
    described = plan(small, {"memory": {"tile_tokens": "auto"}}).describe()["memory"]
    assert "MLP in tiles of 1024 tokens, LM head + loss in tiles of 1024 tokens" in described
    assert "no tiling" in plan(small, {}).describe()["memory"]
    assert "tiles of 64 tokens" in plan(small, {"memory": {"tile_tokens": 64}}).describe()["memory"]


# -- trainers ----------------------------------------------------------------------------------------------------


def trainer_step(kind, memory, lora=False, fault=None, **overrides):
    """The loss and every gradient of one packed micro-batch of long examples through the trainer's ``compute_loss``
    (HF Trainer: labelled logits; SFTTrainer: TRL's fused head), with ``memory`` as the memory section."""
    from padfree_plugins import accelerate
    from padfree_plugins.packing.labelled_logits import HELD_KEY
    from tests.test_trainer import make_trainer, rows

    trainer, _ = make_trainer(kind, packed=False, lora=lora, **overrides)
    accelerate(trainer, {"task": "causal_lm", **({"memory": memory} if memory else {})})
    batch = trainer._prepare_inputs(trainer.data_collator(rows(8, seed=2, longest=120)))
    assert (HELD_KEY in batch) == (kind == "hf" and not (overrides.get("label_smoothing_factor") and not memory))
    labels = batch.get("labels")
    num_items = (labels[:, 1:] != -100).sum() * 2  # as with gradient accumulation over two micro-batches
    model = trainer.model
    inner = patch_of(model).model
    assert all(("forward" in layer.mlp.__dict__) == bool(memory) for layer in inner.model.layers)
    model.zero_grad(set_to_none=True)
    with fault() if fault else _nothing():
        loss = trainer.compute_loss(model, batch, num_items_in_batch=num_items)
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind,lora", [("hf", False), ("hf", True), ("sft", False)])
def test_trainers_train_tiled_with_the_untiled_loss_and_gradients(kind, lora):
    assert_same(trainer_step(kind, TILED, lora=lora), trainer_step(kind, None, lora=lora))


@pytest.mark.parametrize("fault", ["tile_drops_last_token", "loss_normalised_per_tile"])
def test_a_tiling_fault_fails_the_trainer_comparison(fault):
    got = trainer_step("hf", TILED, fault=getattr(faults, fault))
    with pytest.raises(AssertionError):
        assert_same(got, trainer_step("hf", None))


def test_label_smoothing_is_tiled_with_the_trainers_smoothed_loss_and_gradients():
    """The untiled run computes the loss with the trainer's own LabelSmoother from every position's logits."""
    want = trainer_step("hf", None, label_smoothing_factor=0.1)
    assert_same(trainer_step("hf", TILED, label_smoothing_factor=0.1), want)
    with pytest.raises(AssertionError):  # smoothing makes a difference the comparison sees
        assert_same(trainer_step("hf", TILED), want)


def test_label_smoothing_evaluates_the_smoothed_loss_tiled():
    from padfree_plugins import accelerate
    from tests.test_trainer import make_trainer

    losses = []
    for memory in (None, TILED):
        trainer, _ = make_trainer("hf", packed=False, label_smoothing_factor=0.1)
        accelerate(trainer, {"task": "causal_lm", **({"memory": memory} if memory else {})})
        losses.append(trainer.evaluate()["eval_loss"])
    assert abs(losses[0] - losses[1]) < 1e-5


def test_hf_trainer_tiled_loss_builds_no_logits_for_the_row(monkeypatch):
    from padfree_plugins.modeling import tiling

    tiles = []
    original = tiling.TiledHeadLoss.forward

    def counting(ctx, hidden, weight, bias, labels, divisor, tile, *rest):
        tiles.append((hidden.shape[0], tile))
        return original(ctx, hidden, weight, bias, labels, divisor, tile, *rest)

    monkeypatch.setattr(tiling.TiledHeadLoss, "forward", staticmethod(counting))
    trainer_step("hf", TILED)
    assert tiles and tiles[0][1] == TILE and tiles[0][0] > 4 * TILE


def test_a_compute_loss_func_is_refused_with_the_tiled_loss():
    from padfree_plugins import PadfreeError, accelerate
    from tests.test_trainer import make_trainer

    trainer, _ = make_trainer("hf", packed=False)
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()
    with pytest.raises(PadfreeError, match="compute_loss_func.*tile_loss: false"):
        accelerate(trainer, {"task": "causal_lm", "memory": TILED})
    assert patch_of(trainer.model) is None
    accelerate(trainer, {"task": "causal_lm", "memory": {**TILED, "tile_loss": False}}).undo()


def loss_and_grads_of(assembly, model):
    batch = keep_labelled_logits(assembly.collator(make_examples(LENGTHS, seed=3)))
    assembly.forward(model, batch).loss.backward()


def test_check_shows_the_tiles_auto_chose(tmp_path):
    import json

    from typer.testing import CliRunner

    from padfree_plugins.cli import app

    config = tmp_path / "padfree.yaml"
    config.write_text("memory:\n  tile_tokens: auto\n")
    result = CliRunner().invoke(app, ["check", str(config), "--model-type", "llama", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    # transformers' default Llama: hidden 4096, intermediate 11008, vocabulary 32000 -> 4096 x 11008 / 32000 = 1409
    assert json.loads(result.output)["memory"].startswith("MLP in tiles of 4096 tokens, LM head + loss in tiles of "
                                                          "1408 tokens")


def test_a_call_with_labels_but_no_labelled_logits_says_once_that_its_loss_is_untiled(caplog):
    model = causal_lm("llama")
    assembly = assemble(model, {"task": "causal_lm", "memory": TILED})
    try:
        batch = assembly.collator(make_examples(LENGTHS, seed=3))
        with caplog.at_level("WARNING", logger="padfree_plugins"):
            for _ in range(2):
                outputs = assembly.forward(model, batch)
        assert outputs.logits.shape[1] == sum(LENGTHS)  # every position's logits, as asked
        assert sum("keep_labelled_logits(batch) tiles" in r.getMessage() for r in caplog.records) == 1
    finally:
        assembly.undo()
