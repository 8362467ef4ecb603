"""``bench`` parts report progress on stderr, a ``[bench PART] …`` line a step, and keep stdout for the results."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from padfree_plugins.cli import app

QUICK = {
    "batching": ["--examples", "500", "--ranks", "2", "--laws", "lognormal", "--time-steps", "2",
                 "--time-max-tokens", "2048"],
    "collator": ["--batch-sizes", "4", "--batches", "5"],
}


@pytest.mark.parametrize("part", sorted(QUICK))
def test_progress_goes_to_stderr_and_results_to_stdout(part):
    result = CliRunner().invoke(app, ["bench", part, *QUICK[part]])
    assert result.exit_code == 0, result.output
    progress = [line for line in result.stderr.splitlines() if line.startswith(f"[bench {part}] ")]
    assert progress and ("round 3/3" in progress[-1] or "step 2/2" in progress[-1]), result.stderr
    assert "[bench" not in result.stdout
    quiet = CliRunner().invoke(app, ["bench", part, *QUICK[part], "--json"])
    assert quiet.exit_code == 0 and "[bench" not in quiet.output  # --json: the output is JSON alone
    assert json.loads(quiet.stdout)
