"""The one SLURM cluster every test of this folder submits to, started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.slurm.cluster import SlurmCluster, SlurmUnavailable, slurm_cluster


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """A running one-node cluster with two CPUs; the tests skip, saying why, where SLURM cannot run."""
    try:
        with slurm_cluster(cpus=2) as cluster:
            yield cluster
    except SlurmUnavailable as error:
        pytest.skip(f"SLURM is not available here: {error}")
