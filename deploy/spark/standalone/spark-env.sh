#!/usr/bin/env bash
# $SPARK_HOME/conf/spark-env.sh on every node of a Spark standalone cluster
# (master, workers, and the host you submit from). Spark's launch scripts
# source it; only the lines idem cares about are here.

# The Python that runs the driver and the executors' Python workers. It must
# have idem installed (and pyspark of the cluster's Spark version), at the same
# path on every node: a virtualenv built the same way everywhere, e.g.
#   python3 -m venv /opt/idem-venv && /opt/idem-venv/bin/pip install <idem wheel>
export PYSPARK_PYTHON=/opt/idem-venv/bin/python
export PYSPARK_DRIVER_PYTHON=/opt/idem-venv/bin/python

# Bind Spark to the node's private address (placeholder).
# export SPARK_LOCAL_IP=10.0.1.11

# Workers only: what each worker offers to executors.
# export SPARK_WORKER_CORES=8
# export SPARK_WORKER_MEMORY=24g

# IDEM_* settings are read by the driver. Spark standalone runs Python drivers
# in client mode only, so export them in the shell that calls spark-submit
# (see deploy/env.example), not here.
