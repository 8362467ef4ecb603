"""Helpers for plugin authors: tiny models, example batches, and the packed-vs-alone equivalence check.

    from padfree_plugins.testing import assert_packed_matches_alone, tiny_model

    def test_my_architecture():
        model = tiny_model("cohere", "causal_lm", num_key_value_heads=2)
        report = assert_packed_matches_alone(model, {"task": "causal_lm"}, plugin="cohere")
        print(report)  # max differences of the logits and of every parameter's gradient

Nothing here imports pytest: the helpers raise ``AssertionError`` and work in any test runner.
"""

from padfree_plugins.testing.equivalence import (
    EquivalenceReport,
    assert_packed_matches_alone,
    default_task,
    output_of,
    run_alone,
    split_packed,
)
from padfree_plugins.testing.faults import leak_across_boundaries, positions_run_on
from padfree_plugins.testing.models import (
    DEFAULT_LENGTHS,
    TINY_DEFAULTS,
    VOCAB,
    example_batch,
    random_examples,
    tiny_config,
    tiny_model,
    vocab_size_of,
)
from padfree_plugins.testing.undo import ModelState, assert_state_restored, model_state

__all__ = [
    "DEFAULT_LENGTHS", "EquivalenceReport", "ModelState", "TINY_DEFAULTS", "VOCAB", "assert_packed_matches_alone",
    "assert_state_restored", "default_task", "example_batch", "leak_across_boundaries", "model_state", "output_of",
    "positions_run_on", "random_examples", "run_alone", "split_packed", "tiny_config", "tiny_model", "vocab_size_of",
]
