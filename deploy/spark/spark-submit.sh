#!/usr/bin/env bash
# Submit idem as a Spark job: idem_job.py runs `idem run` in the driver.
#
#   deploy/spark/spark-submit.sh [--delta-spark] [-- idem run arguments]
#   e.g. ... -- --group orders --source /shared/in/orders --key order_id \
#               --checkpoint /shared/idem/orders/checkpoint
#
# Settings: the IDEM_* variables (deploy/env.example) in this shell. In client
# mode (the default, and the only mode Spark standalone allows for Python) the
# driver runs here and inherits them. In cluster mode the driver runs on the
# cluster: give it the variables there (YARN: --conf
# spark.yarn.appMasterEnv.IDEM_GROUP=...; Kubernetes: see kubernetes/).
#
# Environment of this script:
#   SPARK_MASTER        local[2] | spark://host:7077 | yarn | k8s://... (default local[2])
#   DEPLOY_MODE         client | cluster (default client)
#   SHUFFLE_PARTITIONS  spark.sql.shuffle.partitions (default 4: the default 200
#                       makes small micro-batches slow; use ~2-3x the total cores)
#   PYSPARK_PYTHON      the Python with idem installed, at the same path on every
#                       node (default: python3 on PATH here)
#   DELTA_PACKAGE       Maven coordinate for --delta-spark
#                       (default io.delta:delta-spark_2.13:4.0.0)
#   APP                 the driver script (default: idem_job.py beside this
#                       file); set it to submit your own PySpark application
#
# --delta-spark: let the job write Delta through delta-spark instead of delta-rs.
# It adds Delta's jars with --packages, which downloads them from Maven Central
# (or the repositories in spark.jars.repositories) when the job starts: the
# submitting host needs that access, or pass pre-downloaded jars with --jars.
# Pick the delta-spark release built for your Spark version: 4.0.x is for
# Spark 4.0.x (Delta's compatibility table lists the others). The driver's
# Python also needs the delta-spark package: pip install 'idem-exactly-once[spark-delta]'.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)

delta_spark=no
if [ "${1:-}" = "--delta-spark" ]; then delta_spark=yes; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi

PYSPARK_PYTHON=${PYSPARK_PYTHON:-$(command -v python3)}
export PYSPARK_PYTHON
export PYSPARK_DRIVER_PYTHON=${PYSPARK_DRIVER_PYTHON:-$PYSPARK_PYTHON}

submit=(
  --master "${SPARK_MASTER:-local[2]}"
  --deploy-mode "${DEPLOY_MODE:-client}"
  --name "idem-${IDEM_GROUP:-job}"
  --conf "spark.pyspark.python=$PYSPARK_PYTHON"
  --conf "spark.sql.shuffle.partitions=${SHUFFLE_PARTITIONS:-4}"
  # IDEM_REDIS_URL carries a password: hide it in the UI and event logs too.
  --conf "spark.redaction.regex=(?i)secret|password|token|access[.]?key|credential|redis_url"
)

if [ "$delta_spark" = yes ]; then
  submit+=(
    --packages "${DELTA_PACKAGE:-io.delta:delta-spark_2.13:4.0.0}"
    --conf spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension
    --conf spark.sql.catalog.spark_catalog=org.apache.spark.sql.delta.catalog.DeltaCatalog
  )
fi

exec spark-submit "${submit[@]}" "${APP:-$here/idem_job.py}" "$@"
