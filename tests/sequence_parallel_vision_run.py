"""torchrun worker of tests/test_sequence_parallel_vision.py: image-text rows under ``sequence_parallel: {size: 2}``
on 2 CPU processes (gloo), every case in one launch.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 tests/sequence_parallel_vision_run.py \
        OUT CASE [CASE ...]

Cases (:data:`CASES`):

* ``forward-<family>`` (``qwen2_5_vl``, ``qwen2_vl``, ``gemma3``, ``qwen3_vl``, ``qwen3_vl_moe``, ``qwen3_5``,
  ``qwen3_5_moe``; ``...-text-rank``:
  rank 1's micro-batch without images; ``...-allgather``: ``sequence_parallel.attention: allgather``;
  ``...-gather``: ``sequence_parallel.mixers: gather``; ``...-zero-state``: under :func:`~padfree_plugins.testing.
  faults.mixer_scans_only_its_slice`; ``...-fault``: under :func:`~padfree_plugins.testing.faults.
  image_features_sliced_off_by_one`; ``...-unsummed``: under :func:`~padfree_plugins.testing.faults.
  tower_gradients_not_summed`; ``forward-qwen3_vl-video``: rank 1's micro-batch a video and text, no image): each
  rank packs its own image-text examples (:func:`rank_examples`) and runs
  ``assembly.forward`` + backward with ``num_items_in_batch`` the label count over both ranks; the losses and the
  gradients (vision tower included) are summed over the ranks (DDP's all-reduce times the world size a DDP loss is
  scaled by). The same process also computes the one-process reference: a second copy of the model, assembled
  without sequence parallelism, on the two ranks' examples packed into one row. ``cut``: whether the group's row is
  cut inside an image's tokens; ``tower``: per rank, the pixel rows (Gemma 3: images) its vision tower encoded in
  each call, and ``own``: per rank, its own micro-batch's; ``pixels_kept``: per rank, whether the joined row's pixels
  held its own where they stand and zeros for the other rank's (never exchanged);
* ``hf``: HF ``Trainer`` on Qwen2.5-VL processor rows (:func:`hf_trainer`), 2 SGD steps, its logged losses and the
  first step's gradients (after DDP's all-reduce);
* ``sft``: TRL ``SFTTrainer`` on conversational Qwen2.5-VL rows with images (:func:`sft_trainer`), the same;
* ``dpo``: TRL ``DPOTrainer`` on Qwen2.5-VL image-text pairs (:func:`dpo_trainer`), 2 SGD steps, the same
  (``prefix_sharing: off``); ``dpo-shared`` (``-gemma3``: on Gemma 3): with ``prefix_sharing: on``;
* ``grpo``: TRL ``GRPOTrainer`` on Qwen2.5-VL prompts with images (:func:`grpo_run`; :func:`grpo_prompts`),
  sequence-parallel (``sp``), sequence-parallel with ``prefix_sharing: on`` (``shared``; ``no-exchange``: that under
  :func:`~padfree_plugins.testing.faults.parent_keys_not_exchanged`; ``allgather``: with all-gather attention) and
  TRL's own run (``padded``: the reference, on the same 2 processes);
* ``rloo``: the same with ``RLOOTrainer`` (``shared`` and ``padded``); ``kto``: ``KTOTrainer`` with its KL term on
  Qwen2.5-VL image-text examples (:func:`kto_run`), ``shared`` and ``padded``.

The one-process references of ``hf``, ``sft`` and ``dpo`` are computed by the test. Rank 0 writes ``{case: result}`` to ``OUT``.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import tempfile

import torch
import torch.distributed as dist

from tests.distributed_common import finish, leave

SP_CONFIG = {"task": "causal_lm", "sequence_parallel": {"size": 2}}
CASES = ("forward-qwen2_5_vl", "forward-qwen2_5_vl-fault", "forward-qwen2_5_vl-unsummed",
         "forward-qwen2_5_vl-text-rank", "forward-qwen3_vl-video",
         "forward-qwen2_5_vl-allgather", "forward-qwen3_vl-allgather", "forward-qwen2_vl",
         "forward-gemma3", "forward-qwen3_vl", "forward-qwen3_vl_moe", "forward-qwen3_5", "forward-qwen3_5_moe",
         "forward-qwen3_5-gather", "forward-qwen3_5-zero-state", "hf", "sft", "dpo", "dpo-shared", "dpo-shared-gemma3", "dpo-shared-qwen3_5",
         "grpo", "rloo", "kto")
STEPS = 2
#: What a ``forward-<family>`` case may end with (see the module docstring).
FORWARD_SUFFIXES = ("-fault", "-unsummed", "-video", "-text-rank", "-allgather", "-zero-state", "-gather")
#: Per rank, per example: (words of text before, images as (height, width) pixels, words after). Rank 0's last
#: example ends with an image, so the group's row is cut inside an image's tokens (asserted: ``cut``).
LAYOUT = (
    [(3, [(56, 28)], 4), (2, [(28, 84), (56, 56)], 1)],
    [(3, [], 3), (1, [(84, 56)], 3)],
)
#: ``forward-qwen2_5_vl-text-rank``: rank 1's micro-batch holds no image (it sends no pixels; the cut falls in rank 0's).
TEXT_RANK_LAYOUT = (LAYOUT[0], [(2, [], 2), (1, [], 2)])
#: Gemma 3: every image is 4 tokens of one size (the count stands in for the images); the cut falls into rank 0's
#: last image, whose 4 tokens attend to each other both ways across the two ranks' slices.
GEMMA3_LAYOUT = (
    [(6, [1], 3), (3, [1, 1], 1)],
    [(1, [], 1), (1, [1], 1)],
)


def family_processor(family: str):
    from tests.vision_trl import processor

    return processor(family)


def family_model(family: str):
    from tests.vision_trl import model

    return model(family, seed=0)


def rank_examples(family: str, rank: int, text_rank: bool | str = False) -> list[dict]:
    """Rank ``rank``'s image-text examples (processor outputs, labels from input_ids): :data:`LAYOUT` (``text_rank``:
    :data:`TEXT_RANK_LAYOUT`; ``"video"``: rank 1's a video and a text example, no image)."""
    if text_rank == "video" and rank == 1:
        from padfree_plugins.testing.vision import image_text_example, synthetic_video_example

        processor = family_processor(family)
        return [synthetic_video_example(processor, family_model(family).config, "a video <image> and its words",
                                        seed=3), image_text_example(processor, "only words here")]
    from padfree_plugins.testing.vision import gemma3_example, image_text_example, synthetic_image
    from tests.vision_trl import words

    processor = family_processor(family)
    examples = []
    layout = GEMMA3_LAYOUT if family == "gemma3" else TEXT_RANK_LAYOUT if text_rank is True else LAYOUT
    for index, (before, sizes, after) in enumerate(layout[rank]):
        seed = 10 * rank + index
        if family == "gemma3":
            pictures = [synthetic_image(56, 56, seed=seed + k) for k in range(len(sizes))]
            text = " ".join([words(seed, before), *("<image>" for _ in pictures), words(seed + 1, after)])
            examples.append(gemma3_example(processor, text, pictures))
        else:
            pictures = [synthetic_image(h, w, seed=seed + k) for k, (h, w) in enumerate(sizes)]
            text = " ".join([words(seed, before), *("<image>" for _ in pictures), words(seed + 1, after)])
            examples.append(image_text_example(processor, text, pictures))
    return examples


def image_tokens(model, batch) -> torch.Tensor:
    """Where the packed ``batch``'s tokens are image placeholders (``[T]``, bool)."""
    return batch["input_ids"][0] == model.config.image_token_id


def gradients(model) -> dict:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def run_forward(family: str, fault: str | None, text_rank: bool | str = False, attention: str = "auto",
                mixers: str = "split") -> dict:
    """One forward + backward of each rank's micro-batch, sequence-parallel (``attention``, ``mixers``: its
    ``sequence_parallel`` options), and the one-process reference."""
    from padfree_plugins import assemble
    from padfree_plugins.testing import faults

    rank = dist.get_rank()
    model = family_model(family)
    reference = copy.deepcopy(model)
    assembly = assemble(model, {**SP_CONFIG, "sequence_parallel": {"size": 2, "attention": attention,
                                                                   "mixers": mixers}})
    mine = assembly.collator(rank_examples(family, rank, text_rank))
    count = torch.tensor((mine["labels"][:, 1:] != -100).sum())
    dist.all_reduce(count)
    seen: list = []
    handle = assembly.model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["inputs_embeds"].shape[1]), with_kwargs=True)
    tower: list = []
    base = assembly.model.model
    joined: list = []
    given = base.register_forward_pre_hook(lambda module, args, kwargs: joined.append(kwargs.get("pixel_values")),
                                           with_kwargs=True)
    counted = (getattr(base, "visual", None) or base.vision_tower).register_forward_pre_hook(
        lambda module, args, kwargs: tower.append(int(next(iter((*args, *kwargs.values()))).shape[0])),
        with_kwargs=True)
    with getattr(faults, fault)() if fault else contextlib.nullcontext():
        loss = assembly.forward(assembly.model, mine, num_items_in_batch=count).loss
        loss.backward()
    handle.remove()
    counted.remove()
    given.remove()
    own = int(mine["pixel_values"].shape[0]) if "pixel_values" in mine else 0
    towers: list = [None, None]
    dist.all_gather_object(towers, (tower, own))
    # the joined row's pixels: this rank's own where they stand, the other rank's never sent (zeros)
    start = towers[0][1] if rank else 0
    pixels = joined[0]
    others = torch.cat([pixels[:start], pixels[start + own:]])
    kept = bool(not others.any() and (not own or torch.equal(pixels[start:start + own], mine["pixel_values"])))
    everyone: list = [None, None]
    dist.all_gather_object(everyone, kept)
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = gradients(assembly.model)
    for grad in grads.values():
        dist.all_reduce(grad)
    # the one-process reference: both ranks' examples in one row, without sequence parallelism
    one = assemble(reference, {"task": "causal_lm"})
    examples = rank_examples(family, 0, text_rank) + rank_examples(family, 1, text_rank)
    whole = one.collator(examples)
    loss_one = one.forward(one.model, whole).loss
    loss_one.backward()
    tokens = image_tokens(one.model, whole)
    half = -(-tokens.numel() // 2)
    cut = bool(tokens[half - 1] and tokens[half])
    return {"loss": float(total), "reference_loss": float(loss_one), "grads": grads,
            "reference_grads": gradients(one.model), "cut": cut, "row": tokens.numel(), "seen": seen,
            "slice": half, "attention": attention_function(model), "tower": [rows for rows, _ in towers],
            "own": [own for _, own in towers], "pixels_kept": everyone,
            "split": split_mixers(model), "whole": split_mixers(model, "WholeRowMixer")}


def split_mixers(model, kind: str = "SplitMixer") -> int:
    """How many of ``model``'s sequence mixers run split across the group (each rank its slice, the state passed;
    ``kind`` ``WholeRowMixer``: on the whole row)."""
    return sum(type(module.__dict__.get("forward")).__name__ == kind for module in model.modules())


def attention_function(model) -> str:
    """The class of the attention function ``model``'s language model runs (``AllGatherAttention``,
    ``UlyssesAttention``)."""
    from transformers import AttentionInterface

    return type(AttentionInterface()[model.config.get_text_config()._attn_implementation]).__name__


# -- trainers ----------------------------------------------------------------------------------------------------------


class Gradients:
    """A callback keeping the first optimizer step's gradients (after DDP's all-reduce)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Keep(TrainerCallback):
            first: dict | None = None

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if self.first is None:
                    self.first = gradients(model)

        return Keep()


def hf_rows(n: int) -> list[dict]:
    """Qwen2.5-VL processor rows of one image each (4, 9 or 16 tokens), labels from input_ids; the group's cut falls
    inside an image at the second step (asserted by the test)."""
    from padfree_plugins.testing.vision import image_text_example, synthetic_image
    from tests.vision_trl import words

    processor = family_processor("qwen2_5_vl")
    rows = []
    for index in range(n):
        side = 56 + 28 * (index % 3)
        pictures = [synthetic_image(side, side, seed=5 * index)]
        text = " ".join([words(index, 1 + 2 * (index % 4)), "<image>", words(index + 4, 1)])
        rows.append({"pixel_values": None, "image_grid_thw": None,
                     **{key: (value.tolist() if isinstance(value, torch.Tensor) else value)
                        for key, value in image_text_example(processor, text, pictures).items()}})
    return rows


def hf_trainer(config: dict, ranks: int = 1):
    """HF ``Trainer`` on Qwen2.5-VL processor rows, 2 examples a micro-batch per rank, SGD; ``ranks``: the one-process
    reference, one micro-batch of that many ranks' examples. (The trainer passes Qwen2.5-VL no
    ``num_items_in_batch``: its loss is the mean over a micro-batch's labels, and under sequence parallelism over the
    group's row's, so the reference is one micro-batch of the global batch.)"""
    import datasets
    from transformers import Trainer, TrainingArguments

    from padfree_plugins import accelerate

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=2 * ranks,
                             learning_rate=0.5, optim="sgd",
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                             seed=0, disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)
    trainer = Trainer(model=family_model("qwen2_5_vl"), args=args,
                      train_dataset=datasets.Dataset.from_list(hf_rows(8)))
    keep = Gradients()
    trainer.add_callback(keep)
    accelerate(trainer, config)
    return trainer, keep


def sft_trainer(config: dict, ranks: int = 1):
    """TRL ``SFTTrainer`` on conversational Qwen2.5-VL rows (a user turn after one image, the assistant's answer),
    TRL's vision collator, its gradient checkpointing, SGD; ``ranks`` as :func:`hf_trainer`'s."""
    import datasets
    import trl

    from padfree_plugins import accelerate
    from padfree_plugins.testing.vision import synthetic_image
    from tests.vision_trl import words

    rows = [{"messages": [{"role": "user", "content": words(index, 1 + 2 * (index % 4))},
                          {"role": "assistant", "content": words(index + 3, 2 + index % 3)}],
             "images": [synthetic_image(56 + 28 * (index % 3), 84, seed=index)]} for index in range(8)]
    args = trl.SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=2 * ranks,
                         learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
                         save_strategy="no", report_to="none", seed=0, disable_tqdm=True, use_cpu=True, bf16=False,
                         dataloader_pin_memory=False)
    trainer = trl.SFTTrainer(model=family_model("qwen2_5_vl"), args=args,
                             train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=family_processor("qwen2_5_vl"))
    keep = Gradients()
    trainer.add_callback(keep)
    accelerate(trainer, config)
    return trainer, keep


def dpo_trainer(config: dict | None, batch_size: int, family: str = "qwen2_5_vl"):
    """TRL ``DPOTrainer`` (sigmoid loss, a separate reference model) on the family's image-text pairs (Qwen2.5-VL's
    by default), SGD, accelerated with ``config`` (``None``: TRL's own, padded)."""
    import datasets
    import trl

    from padfree_plugins import accelerate
    from padfree_plugins.testing.vision import synthetic_image
    from tests.vision_trl import pair

    model = family_model(family)
    args = trl.DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch_size, max_steps=STEPS,
                         learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
                         report_to=[], seed=0, beta=0.1, save_strategy="no", use_cpu=True, bf16=False,
                         disable_tqdm=True, max_length=None)
    rows = [pair(3 * index, [synthetic_image(84 + 28 * (index % 2), 112, seed=index)]) for index in range(4 * STEPS)]
    trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args,
                             train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=family_processor(family))
    keep = Gradients()
    trainer.add_callback(keep)
    if config is not None and accelerate(trainer, config).trainer_plugin != "trl_dpo":
        sys.exit("dpo: accelerate() did not take the trl_dpo plugin")
    return trainer, keep


class Calls:
    """Per packed forward of ``model`` on this rank: the whole row the base model got (its tokens), whether the
    group's cut falls between two image tokens, its shared prompts (:func:`shared_layout`), and the tokens its
    language model got (the slice); per call of its vision tower, the pixel rows it encoded."""

    def __init__(self, model) -> None:
        self.rows, self.slices, self.shared, self.image = [], [], [], model.config.image_token_id
        base = model.model
        self.tower, self.packed = [], False
        self.handles = [
            base.register_forward_pre_hook(self.row, with_kwargs=True),
            base.register_forward_hook(lambda *args: setattr(self, "packed", False)),
            (getattr(base, "visual", None) or base.vision_tower).register_forward_pre_hook(
                lambda module, args, kwargs: self.tower.append(int(next(iter((*args, *kwargs.values()))).shape[0]))
                if self.packed else None,
                with_kwargs=True),
            base.language_model.register_forward_pre_hook(
                lambda module, args, kwargs: self.slices.append(kwargs["inputs_embeds"].shape[1])
                if kwargs.get("cu_seq_lens_q") is not None else None, with_kwargs=True)]

    def row(self, module, args, kwargs) -> None:
        if kwargs.get("cu_seq_lens_q") is None:
            return
        self.packed = True
        tokens = kwargs["input_ids"][0] == self.image
        half = tokens.numel() // 2
        self.rows.append((tokens.numel(), bool(tokens[half - 1] and tokens[half])))
        self.shared.append(shared_layout(kwargs, half))

    def remove(self) -> dict:
        for handle in self.handles:
            handle.remove()
        return {"rows": self.rows, "slices": self.slices, "shared": self.shared, "tower": self.tower}


def shared_layout(kwargs: dict, cut: int) -> tuple[int, bool, list, list] | None:
    """A packed call's shared row as the base model got it (``None``: not shared): its prompts held once, whether a
    completion's last token lies in another rank's slice (of ``cut`` tokens) than its prompt's first, and each
    segment's parent and boundaries."""
    from padfree_plugins.packing.prefixes import SHARED_PREFIXES_KEY

    shared = kwargs.get(SHARED_PREFIXES_KEY)
    if shared is None:
        return None
    bounds = kwargs["cu_seq_lens_q"].tolist()
    crossing = any((bounds[segment + 1] - 1) // cut != bounds[parent] // cut
                   for segment, parent in enumerate(shared.parents) if parent >= 0)
    return len({parent for parent in shared.parents if parent >= 0}), crossing, list(shared.parents), bounds


def grpo_prompts():
    """tests/test_trl_vision_rl.py's 16 prompts, the one rank 1 samples first (index 10) with two large images (24
    tokens each): a shared row's rank 1 part is the longer, and the group's cut falls inside its first image
    (asserted)."""
    import datasets

    from tests import vision_trl

    rows = [vision_trl.prompt(index, vision_trl.images(3 * index + 1 + index % 2)) for index in range(16)]
    rows[10] = vision_trl.prompt(10, [vision_trl.synthetic_image(112, 168, seed=10 + k) for k in range(2)])
    return datasets.Dataset.from_list(rows)


def grpo_run(accelerated: bool, sharing: str = "off", fault: bool = False, attention: str = "auto",
             kind: str = "grpo") -> dict:
    """TRL ``GRPOTrainer`` (``kind`` ``rloo``: ``RLOOTrainer``) on Qwen2.5-VL prompts with images
    (tests/test_trl_vision_rl.py's), one SGD step on 2 processes: under ``sequence_parallel: {size: 2}``
    (``accelerated``) or TRL's own run (padded, the reference, on the same per-rank batches and sampled completions).
    Its loss, first step's gradients and every completion scored."""
    from padfree_plugins import accelerate
    from padfree_plugins.testing import faults
    from tests import test_trl_vision_rl

    path = [test_trl_vision_rl.model_dir("qwen2_5_vl") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)  # transformers saves a checkpoint from the main process only
    test_trl_vision_rl.model_dir = lambda family: path[0]
    test_trl_vision_rl.prompts = grpo_prompts
    build = test_trl_vision_rl.build
    completions: list = []
    trainer = build(kind, "qwen2_5_vl", tempfile.mkdtemp(), seen=completions, max_steps=1,
                    per_device_train_batch_size=4, optim="sgd", learning_rate=0.5)
    keep = Gradients()
    trainer.add_callback(keep)
    if accelerated:
        accelerate(trainer, {**SP_CONFIG, "prefix_sharing": sharing,
                             "sequence_parallel": {"size": 2, "attention": attention}})
    calls = Calls(trainer.model)
    with faults.parent_keys_not_exchanged() if fault else contextlib.nullcontext():
        trainer.train()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, completions)
    return {**trainer_result(trainer, keep), "calls": calls.remove(), "completions": everyone,
            "attention": attention_function(trainer.model)}


def kto_run(accelerated: bool) -> dict:
    """TRL ``KTOTrainer`` with its KL term on Qwen2.5-VL image-text examples (tests/test_trl_vision_rl.py's), one SGD
    step on 2 processes, 4 examples a rank: with ``prefix_sharing: on`` under ``sequence_parallel: {size: 2}``
    (``accelerated``) or TRL's own run (padded, the reference)."""
    import datasets
    import trl

    from padfree_plugins import accelerate
    from tests import vision_trl

    policy = family_model("qwen2_5_vl")
    rows = [vision_trl.unpaired(index, vision_trl.images(index)) for index in range(16)]
    args = trl.KTOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=1, optim="sgd",
                         learning_rate=0.5, lr_scheduler_type="constant", logging_steps=1, report_to=[], seed=0,
                         beta=0.1, save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True,
                         dataloader_pin_memory=False)
    trainer = trl.KTOTrainer(model=policy, ref_model=copy.deepcopy(policy).eval(), args=args,
                             train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=family_processor("qwen2_5_vl"))
    keep = Gradients()
    trainer.add_callback(keep)
    if accelerated and accelerate(trainer, {**SP_CONFIG, "prefix_sharing": "on"}).trainer_plugin != "trl_kto":
        sys.exit("kto: accelerate() did not take the trl_kto plugin")
    calls = Calls(trainer.model)
    trainer.train()
    return {**trainer_result(trainer, keep), "calls": calls.remove()}


def trainer_result(trainer, keep) -> dict:
    history = trainer.state.log_history
    return {"losses": [entry["loss"] for entry in history if "loss" in entry],
            "margins": [entry["rewards/margins"] for entry in history if "rewards/margins" in entry],
            "grads": keep.first,
            "packed": [entry.get("padfree/packed_calls") for entry in history if "loss" in entry],
            "shared": [entry.get("padfree/shared_calls") for entry in history if "loss" in entry]}


def run_case(case: str) -> dict:
    if case.startswith("forward-"):
        family = case.removeprefix("forward-")
        for suffix in FORWARD_SUFFIXES:
            family = family.removesuffix(suffix)
        fault = "image_features_sliced_off_by_one" if case.endswith("-fault") else \
            "mixer_scans_only_its_slice" if case.endswith("-zero-state") else \
            "tower_gradients_not_summed" if case.endswith("-unsummed") else None
        return run_forward(family, fault, "video" if case.endswith("-video") else case.endswith("-text-rank"),
                           "allgather" if case.endswith("-allgather") else "auto",
                           "gather" if case.endswith("-gather") else "split")
    if case == "rloo":
        return {"shared": grpo_run(True, "on", kind="rloo"), "padded": grpo_run(False, kind="rloo")}
    if case == "kto":
        return {"shared": kto_run(True), "padded": kto_run(False)}
    if case == "grpo":
        return {"sp": grpo_run(True), "shared": grpo_run(True, "on"), "no-exchange": grpo_run(True, "on", True),
                "allgather": grpo_run(True, "on", attention="allgather"), "padded": grpo_run(False)}
    if case == "hf":
        trainer, keep = hf_trainer(SP_CONFIG)
    elif case == "sft":
        trainer, keep = sft_trainer(SP_CONFIG)
    elif case == "dpo":
        trainer, keep = dpo_trainer({**SP_CONFIG, "prefix_sharing": "off"}, batch_size=2)
    else:  # dpo-shared[-<family>]
        trainer, keep = dpo_trainer({**SP_CONFIG, "prefix_sharing": "on"}, batch_size=2,
                                    family=case.removeprefix("dpo-shared").removeprefix("-") or "qwen2_5_vl")
    calls = Calls(trainer.model)
    trainer.train()
    return {**trainer_result(trainer, keep), "calls": calls.remove(), "split": split_mixers(trainer.model)}


def main(out: str, cases: list[str]) -> None:
    from accelerate import PartialState

    state = PartialState(cpu=True)
    if state.num_processes != 2:
        sys.exit("launch with torchrun --nproc_per_node 2: one sequence-parallel group of 2")
    results = {}
    for case in cases:
        results[case] = run_case(case)
    finish(results, out)


if __name__ == "__main__":
    unknown = [case for case in sys.argv[2:] if case not in CASES]
    if unknown:
        sys.exit(f"cases must be among {', '.join(CASES)}, not {unknown}")
    main(sys.argv[1], sys.argv[2:])
    leave()
