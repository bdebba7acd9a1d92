"""The host's compute lock (``compute_lock_path``) on real ``serve`` processes.

Co-located stages whose threads together exceed the cores take turns computing: each takes the
lock file around every llama_decode — the head's own steps and the native frame path's decodes
below it. Proof: while the test holds the lock, a stage that shares it computes nothing (its
stream stalls), and once released the text is the unsplit model's, as if nothing had happened.
"""

from __future__ import annotations

import fcntl
import os
import time

import pytest
from support.pipeline import StreamingRun, assert_no_active_sessions, reference_texts

PROMPT = "The three primary colours are"
TOKENS = 40


@pytest.fixture(scope="module")
def reference(smollm2):
    return reference_texts(smollm2, [PROMPT], TOKENS)[0]


class Held:
    """The lock file, locked by this test process (another open file description than the
    stages': flock makes them wait)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


@pytest.mark.parametrize("locked_stage", [0, 1], ids=["head", "final stage"])
def test_a_stage_that_shares_the_compute_lock_computes_nothing_while_another_holds_it(
        smollm2, start_pipeline, tmp_path, reference, locked_stage):
    """The lock on one stage only (the other free): held mid-generation — decode frames below the head
    run on the native path, the head's own steps in its lone loop — the stream stalls; released, it
    goes on to the unsplit model's text."""
    lock = str(tmp_path / "compute.lock")
    paths = [None, None]
    paths[locked_stage] = lock
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, compute_lock_path=paths)
    run = StreamingRun(pipeline.head_endpoint, PROMPT, TOKENS, after_pieces=4)
    assert run.started.wait(120)
    held = Held(lock)
    try:
        time.sleep(0.5)  # the decodes that had the lock before the test took it end
        stalled_at = len(run.pieces)
        time.sleep(1.5)
        assert len(run.pieces) == stalled_at, "a stage decoded while another process held the compute lock"
        assert len(run.pieces) < TOKENS and not run.outcome
    finally:
        held.release()
    run.join(120)
    assert run.error is None, run.error
    assert "".join(run.pieces) == reference
    assert_no_active_sessions(pipeline.configs)


def test_a_compute_lock_path_that_cannot_be_opened_is_refused_naming_the_field(smollm2, tmp_path):
    """A stage whose lock file cannot be opened does not start: the error names the field and path."""
    from skippy_stage.config import StageConfig
    from skippy_stage.errors import ConfigError
    from skippy_stage.model.compute_lock import ComputeLock

    missing = str(tmp_path / "no-such-dir" / "compute.lock")
    with pytest.raises(ConfigError, match=r"compute_lock_path .*no-such-dir"):
        ComputeLock(missing, stage_id="stage-1")
    with pytest.raises(ConfigError, match="compute_lock_path"):
        StageConfig.from_dict({"run_id": "r", "model_path": str(smollm2), "stage_id": "s", "stage_index": 0,
                               "layer_start": 0, "layer_end": 30, "compute_lock_path": ""})
