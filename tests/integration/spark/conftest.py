"""One local Spark session (local[2]) for every Spark test of the run: it takes ~7 s to start."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from idem.spark.session import local_session


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """The shared local Spark session (UI off, 2 shuffle partitions, UTC)."""
    session = local_session("idem-tests", fast_start=True)
    yield session
    session.stop()
