"""A reward function for TRL's ``grpo`` / ``rloo`` scripts in the launcher tests
(``--reward_funcs tests.trl_launcher_rewards.length_reward``): longer completions are better."""


def length_reward(completions, **kwargs):
    return [len(text) / 10 for text in completions]
