"""``requeue_on_failure``: when a SLURM job whose task failed is requeued; the decision alone.

The requeued jobs themselves run under ``make test-slurm`` (``tests/slurm/test_slurm_resume.py``).
"""

from __future__ import annotations

import pytest

from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.strategies.resume.requeue_failed import requeue_decision

JOB = {"SLURM_JOB_ID": "42"}


def test_a_job_that_trained_is_requeued_up_to_the_limit() -> None:
    assert requeue_decision(2, JOB, steps_this_attempt=5) == (True, "requeue 1 of at most 2")
    assert requeue_decision(2, {**JOB, "SLURM_RESTART_COUNT": "1"}, 5) == (True, "requeue 2 of at most 2")
    assert requeue_decision(2, {**JOB, "SLURM_RESTART_COUNT": "2"}, 5) == (
        False,
        "not requeued: requeued 2 time(s) already, requeue_on_failure=2",
    )


def test_never_in_a_loop_nor_off_slurm() -> None:
    assert requeue_decision(3, JOB, steps_this_attempt=0) == (
        False,
        "not requeued: this attempt failed before its first step, and another would too",
    )
    assert requeue_decision(0, JOB, 5) == (False, "requeue_on_failure is off")
    assert requeue_decision(1, {}, 5) == (False, "not a SLURM job")


@pytest.mark.parametrize("limit", [-1, 1.5, True, "2"])
def test_requeue_on_failure_says_what_it_accepts(limit: object) -> None:
    with pytest.raises(ValueError, match=r"requeue_on_failure must be how many times .* got "):
        MGPUDDPStrategy(requeue_on_failure=limit)  # type: ignore[arg-type]
