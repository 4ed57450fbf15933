"""The Redis URL's secrets never show where Spark displays a query (plans, the UI's SQL tab,
logs of the plan): the retry stream hands the config to its executors as data source
options, and Spark hides an option whose name matches ``spark.sql.redaction.options.regex``
(``(?i)url`` unless a cluster changed it)."""

from __future__ import annotations

import contextlib
import io

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.types import StringType, StructField, StructType

from idem.config import IdemConfig
from idem.spark.retry_source import retry_stream

pytestmark = [pytest.mark.integration, pytest.mark.spark]

SECRET = "s3cr3t-Pa55"


def test_the_retry_streams_plan_shows_no_redis_password(spark: SparkSession) -> None:
    config = IdemConfig(
        group="plans",
        redis_url=f"rediss://idem:{SECRET}@10.0.0.5:6380/0?ssl_password={SECRET}",
        engine="delta-rs",
    )
    schema = StructType([StructField("order_id", StringType())])
    stream = retry_stream(spark, schema=schema, config=config)
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        stream.explain(extended=True)
    plan = shown.getvalue()
    assert "idem_retry" in plan  # the plan printed is the retry stream's
    assert SECRET not in plan
    assert SECRET not in stream._jdf.queryExecution().toString()
