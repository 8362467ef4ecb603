"""plugins/padfree-axolotl without axolotl: the ``padfree:`` key (absent: nothing; inline or a path; unknown keys;
axolotl's own packing refused with the reason), and the trainer plugin for ``AxolotlTrainer`` on a stand-in that
overrides ``compute_loss`` / ``prediction_step`` and evaluates with its own ``eval_data_collator``, as axolotl 0.21's
does: packed, its curve and eval loss those of the padded run. ``axolotl train`` itself, in axolotl's own Python 3.12
environment: tests/test_axolotl_train.py."""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from padfree_plugins import ConfigError, PluginHost, accelerate
from tests.conftest import tiny_config
from tests.test_trainer import losses, rows, tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "padfree-axolotl"))
from padfree_axolotl import trainer as axolotl_trainer  # noqa: E402
from padfree_axolotl.args import PadfreeArgs  # noqa: E402
from padfree_axolotl.config import acceleration_config  # noqa: E402

STEPS = 10


def test_without_the_key_the_plugin_does_nothing():
    assert acceleration_config({"base_model": "m", "sample_packing": True}) is None  # not even the refusal
    assert PadfreeArgs.model_validate({"sample_packing": True}).padfree is None


def test_the_config_inline_equals_the_config_from_its_path(tmp_path):
    path = tmp_path / "padfree.yaml"
    path.write_text("attention: exact\nunpad: always\n")
    inline = acceleration_config({"padfree": {"attention": "exact", "unpad": "always"}})
    from_path = acceleration_config({"padfree": str(path)})
    assert inline.attention == from_path.attention == "exact" and inline.unpad == from_path.unpad == "always"
    assert acceleration_config({"padfree": {}}).unpad == "auto"  # an empty mapping: every default
    with pytest.raises(ConfigError, match="does not exist"):
        acceleration_config({"padfree": str(tmp_path / "missing.yaml")})
    with pytest.raises(ConfigError, match="the path of its YAML file"):
        acceleration_config({"padfree": True})


def test_an_unknown_key_suggests_the_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"^padfree: .*attentoin.*attention"):
        acceleration_config({"padfree": {"attentoin": "exact"}})
    with pytest.raises(ValueError, match=r"attentoin.*attention"):  # pydantic's error when axolotl validates
        PadfreeArgs.model_validate({"padfree": {"attentoin": "exact"}})


@pytest.mark.parametrize("option", ["sample_packing", "batch_flattening"])
def test_axolotls_own_packing_beside_padfree_is_refused_with_the_reason(option):
    cfg = {"padfree": {"attention": "exact"}, option: True}
    with pytest.raises(ConfigError, match=rf"{option}: true and padfree: are both set\. axolotl's {option} .*"
                                          rf"Remove {option}"):
        acceleration_config(cfg)
    with pytest.raises(ValueError, match=rf"{option}: true and padfree: are both set"):
        PadfreeArgs.model_validate(cfg)
    assert cfg == {"padfree": {"attention": "exact"}, option: True}  # nothing changed
    assert acceleration_config({"padfree": {"attention": "exact"}, option: False}) is not None


class AxolotlTrainer(Trainer):
    """A stand-in for axolotl 0.21's ``AxolotlTrainer`` (matched by class name and module): ``compute_loss`` and
    ``prediction_step`` of its own, and a collator of its own for evaluation, read in ``_get_dataloader``."""

    def __init__(self, *args, eval_data_collator=None, **kwargs):
        self.eval_data_collator = eval_data_collator
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False,
                        dataloader_key=None):
        own, self.data_collator = self.data_collator, (self.data_collator if is_training else
                                                         self.eval_data_collator)
        try:
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
        finally:
            self.data_collator = own


AxolotlTrainer.__module__ = "axolotl.core.trainers.base"


def host_with_plugin() -> PluginHost:
    """A host with the trainer plugin: from its entry point where the package is installed (scripts/setup.sh),
    else registered here."""
    host = PluginHost()
    if "axolotl_trainer" not in host.records:
        host.add("axolotl_trainer", axolotl_trainer)
    assert host.records["axolotl_trainer"].status == "ok"
    return host


def axolotl_like_trainer() -> AxolotlTrainer:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=2), attn_implementation="sdpa")
    padding = copy.deepcopy(tokenizer())
    padding.padding_side = "right"
    collator = DataCollatorForSeq2Seq(padding, padding=True, label_pad_token_id=-100)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=4,
                             per_device_eval_batch_size=5, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                             report_to="none", seed=0, disable_tqdm=True, dataloader_pin_memory=False)
    return AxolotlTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows(32)),
                          eval_dataset=datasets.Dataset.from_list(rows(13, seed=1)), data_collator=collator,
                          eval_data_collator=copy.copy(collator))


def test_axolotl_trainer_takes_the_packed_path_and_its_eval_collator_equal_to_padded():
    padded = axolotl_like_trainer()
    padded.train()
    want_curve, want_eval = losses(padded), padded.evaluate()["eval_loss"]

    trainer = axolotl_like_trainer()
    own_eval_collator = trainer.eval_data_collator
    acceleration = accelerate(trainer, {"attention": "exact"},
                              host=host_with_plugin())
    assert acceleration.describe()["wrapper"] == "AxolotlTrainerPatch (plugin axolotl_trainer)"
    assert trainer.eval_data_collator is trainer.data_collator  # evaluation packs too
    trainer.train()
    torch.testing.assert_close(torch.tensor(losses(trainer)), torch.tensor(want_curve), atol=1e-5, rtol=0)
    assert want_curve[-1] < want_curve[0] - 0.05, "the reference did not train: the comparison would prove little"
    assert trainer.evaluate()["eval_loss"] == pytest.approx(want_eval, abs=1e-5)
    acceleration.undo()
    assert trainer.eval_data_collator is own_eval_collator


def test_without_the_trainer_plugin_it_would_take_the_generic_path():
    """The plugin is what claims it: without it, the generic path (``any_trainer``) does, padded batches kept."""
    trainer = axolotl_like_trainer()
    acceleration = accelerate(trainer, {"attention": "exact"}, host=PluginHost(block=["axolotl_trainer"]))
    assert acceleration.describe()["wrapper"] == "AnyTrainerPatch (plugin any_trainer)"
    acceleration.undo()


def test_axolotl_trainer_options_it_cannot_pack_are_refused_and_nothing_changes():
    trainer = axolotl_like_trainer()
    trainer.args.orpo_alpha = 0.1
    collator, compute_loss = trainer.data_collator, trainer.compute_loss
    with pytest.raises(ConfigError, match="orpo_alpha: ORPO"):
        accelerate(trainer, {"attention": "exact"}, host=host_with_plugin())
    assert trainer.data_collator is collator and trainer.compute_loss == compute_loss
    assert not any(hasattr(m, "_padfree_original_forward") for m in trainer.model.modules())


def test_the_fused_trl_plugins_are_blocked_on_a_copy_for_a_trl_without_the_fused_head():
    from padfree_axolotl.config import FUSED_TRL_PLUGINS, without_fused_trl_plugins

    config = acceleration_config({"padfree": {"attention": "exact", "plugins": {"block": ["trl_kto"]}}})
    generic = without_fused_trl_plugins(config)
    assert sorted(generic.plugins.block) == sorted(FUSED_TRL_PLUGINS)  # trl_kto once
    assert config.plugins.block == ["trl_kto"]  # the user's config is unchanged
