"""The reward function of the ``axolotl train`` GRPO test (tests/test_axolotl_train.py), which axolotl imports by
its name in the config (``trl.reward_funcs``): longer completions are better."""


def length(prompts, completions, **kwargs) -> list[float]:
    return [len(text) / 10 for text in completions]
