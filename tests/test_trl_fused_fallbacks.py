"""A fused log-probability call that runs padded (TRL's own forward) says why: once per reason and trainer patch, in
a warning; and every call is counted, packed or padded (by reason), in ``Acceleration.describe()`` and the trainer's
log (``padfree/packed_calls``, ``padfree/padded_calls``).

* Image-text calls (TRL's DPO vision collator, Qwen2.5-VL) made malformed — a grid dropped, a placeholder token at a
  pad: the call runs padded (TRL's forward refuses it too), said once for three calls, counted three times; a
  well-formed call beside them is packed and counted. A new acceleration of the same trainer says it again.
* A left-padded image-text call is packed and gives TRL's padded log-probabilities and gradients; the same call with
  TRL's ``mm_token_type_ids`` laid out for right padding (its prompts' modalities shifted off their tokens) runs
  padded with TRL's own result, and the warning names the row, the columns and the fix (left padding).
* Text calls (a tiny Llama's fused head): a mask with holes is said and counted; a call without any pad runs as it is,
  counted apart, without a warning.
"""

from __future__ import annotations

import warnings

import datasets
import pytest
import torch

from padfree_plugins import accelerate
from tests.test_trl_dpo_vision import CALL_PAIRS, pair, trainer_for
from tests.test_trl_fused import MODELS, SHAPES, fused, packed_copy, padded_batch
from tests.test_trl_fused import fused_call as text_call
from tests.vision_trl import fused_call

pytest.importorskip("PIL")


def padded_warnings(record) -> list[str]:
    return [str(item.message) for item in record if "runs padded" in str(item.message)]


def call_trainer():
    return trainer_for(datasets.Dataset.from_list([pair(i, p) for i, p in enumerate(CALL_PAIRS)]))


def call_batch(trainer) -> dict:
    """One fused call of TRL's DPO vision collator: rows of 0, 1, 2 and 1 images, right-padded."""
    return trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(len(CALL_PAIRS))])


def grid_dropped(batch: dict) -> dict:
    last = int(batch["image_grid_thw"][-1].prod())
    return {**batch, "image_grid_thw": batch["image_grid_thw"][:-1], "pixel_values": batch["pixel_values"][:-last]}


def placeholder_at_a_pad(batch: dict) -> dict:
    row = int((batch["attention_mask"] == 0).any(1).int().argmax())
    ids = batch["input_ids"].clone()
    ids[row, -1] = ids[batch["input_ids"] == 321][0]  # <|image_pad|>, after the row's last real token
    assert batch["attention_mask"][row, -1] == 0
    return {**batch, "input_ids": ids}


MALFORMED = {"grid dropped": (grid_dropped, "its media cannot be split by row"),
             "placeholder at a pad": (placeholder_at_a_pad, "media placeholder tokens sit at padded positions")}


@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_call_runs_padded_said_once_and_counted(kind):
    malform, reason = MALFORMED[kind]
    trainer = call_trainer()
    batch = call_batch(trainer)
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            with pytest.raises(Exception):  # noqa: B017 — TRL's own forward refuses the malformed call too
                fused_call(trainer, malform(batch))
        fused_call(trainer, batch)
    said = padded_warnings(record)
    assert len(said) == 1 and reason in said[0] and said[0].startswith("DPOTrainer: "), said
    calls = acceleration.trainer_patch.calls
    assert (calls.packed, calls.padded) == (1, {reason: 3})
    assert acceleration.describe()["fused calls"] == f"1 packed (1 with shared prompts), 3 padded; 3 padded: {reason}"
    trainer.log({"loss": 1.0})
    logged = trainer.state.log_history[-1]
    assert (logged["padfree/packed_calls"], logged["padfree/padded_calls"]) == (1, 3)
    acceleration.undo()
    assert vars(trainer).get("log") is None, "undo() leaves the trainer's own log"
    again = accelerate(trainer, {"task": "causal_lm"})  # its own count and its own warnings
    with pytest.warns(UserWarning, match="runs padded"), pytest.raises(Exception):  # noqa: B017
        fused_call(trainer, malform(batch))
    assert again.trainer_patch.calls.padded == {reason: 1}
    again.undo()


def left_padded(batch: dict) -> dict:
    """``batch`` with every row's tokens moved to the right end (left padding), every per-token tensor alike."""
    pads = (batch["attention_mask"] == 0).sum(1).tolist()
    shape = batch["attention_mask"].shape
    return {key: torch.stack([row.roll(pad) for row, pad in zip(value, pads)])
            if isinstance(value, torch.Tensor) and value.shape == shape else value for key, value in batch.items()}


def outcome(trainer, batch: dict):
    """The fused call's per-token outputs and gradients, or the type of the error it raised."""
    try:
        return fused_call(trainer, batch)
    except Exception as error:  # noqa: BLE001 — compared with the padded run's own
        return type(error)


def test_a_left_padded_call_is_packed_and_misaligned_modalities_are_said_precisely():
    trainer = call_trainer()
    right = call_batch(trainer)
    batch = left_padded(right)
    assert "mm_token_type_ids" in batch and (batch["attention_mask"][:, 0] == 0).any()
    # TRL's inputs as a processor padding on the right makes them for TRL's left-padded prompts
    misaligned = {**batch, "mm_token_type_ids": right["mm_token_type_ids"]}
    want, want_misaligned = fused_call(trainer, batch), outcome(trainer, misaligned)
    acceleration = accelerate(trainer, {"task": "causal_lm"})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = fused_call(trainer, batch)
        got_misaligned = outcome(trainer, misaligned)
    acceleration.undo()
    (values, grads), (want_values, want_grads) = got, want
    for key, value in want_values.items():
        torch.testing.assert_close(values[key], value, atol=1e-5, rtol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-4, rtol=1e-4)
    if isinstance(want_misaligned, type):
        assert got_misaligned is want_misaligned
    else:  # TRL's own result, exactly
        assert all(torch.equal(got_misaligned[0][key], value) for key, value in want_misaligned[0].items())
    said = padded_warnings(record)
    assert len(said) == 1, said
    assert "mm_token_type_ids do not line up with its tokens" in said[0]
    assert "shifted by its" in said[0] and "padding_side = 'left'" in said[0], said[0]
    assert acceleration.trainer_patch.calls.packed == 1 and acceleration.trainer_patch.calls.padded_total == 1


def test_text_calls_that_run_padded_are_said_once_and_counted():
    torch.manual_seed(0)
    reference = fused(MODELS["llama"]())
    packed, assembly, head = packed_copy(reference)
    batch = padded_batch(SHAPES, "grpo", reference.config.vocab_size)
    holed = {**batch, "attention_mask": batch["attention_mask"].clone()}
    row = 2  # 7 prompt tokens, 2 completion tokens
    start = int(holed["attention_mask"][row].argmax())
    holed["attention_mask"][row, start + 1] = 0  # a hole inside the row's prompt
    full = padded_batch([(3, 4), (2, 5)], "right", reference.config.vocab_size)
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(2):
            assert torch.equal(text_call(packed, holed).log_probs, text_call(reference, holed).log_probs)
        text_call(packed, full)  # no pad: nothing to gain, run as it is, not a fallback
        text_call(packed, batch)
    said = padded_warnings(record)
    assert len(said) == 1 and "attention_mask has holes" in said[0] and f"row {row}" in said[0], said
    calls = head.calls
    assert (calls.packed, calls.unpadded, calls.padded_total) == (1, 1, 2)
    assert calls.describe() == ("1 packed, 2 padded, 1 without padding (run as they are); 2 padded: its "
                                "attention_mask has holes (a row's real tokens are not one run)")
    assembly.undo()
