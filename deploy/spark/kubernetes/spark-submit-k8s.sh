#!/usr/bin/env bash
# Submit idem to Spark on Kubernetes in cluster mode: the driver runs in a pod
# and creates its executor pods; both start from pod-template.yaml, which gives
# them the IDEM_* settings (ConfigMap idem-settings, Secret idem-redis).
#
#   K8S_API=https://<api-server>:6443 IMAGE=registry.example.com/idem-spark:0.1.0 \
#     deploy/spark/kubernetes/spark-submit-k8s.sh [idem run arguments]
#
# Before: kubectl -n idem apply -f manifests/ and your copy of secret.example.yaml.
# IMAGE: Spark (the same version as this spark-submit), Python with idem, and
# deploy/spark/idem_job.py copied to /opt/idem/idem_job.py (see README).
# Also: NAMESPACE (idem), EXECUTORS (2), SHUFFLE_PARTITIONS (8).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
: "${K8S_API:?set K8S_API to the API server URL, e.g. https://10.0.0.1:6443}"
: "${IMAGE:?set IMAGE to an image with Spark, Python and idem}"

exec spark-submit \
  --master "k8s://$K8S_API" \
  --deploy-mode cluster \
  --name idem-orders \
  --conf "spark.kubernetes.namespace=${NAMESPACE:-idem}" \
  --conf "spark.kubernetes.container.image=$IMAGE" \
  --conf spark.kubernetes.authenticate.driver.serviceAccountName=spark \
  --conf "spark.kubernetes.driver.podTemplateFile=$here/pod-template.yaml" \
  --conf "spark.kubernetes.executor.podTemplateFile=$here/pod-template.yaml" \
  --conf spark.kubernetes.driver.podTemplateContainerName=spark \
  --conf spark.kubernetes.executor.podTemplateContainerName=spark \
  --conf "spark.executor.instances=${EXECUTORS:-2}" \
  --conf "spark.sql.shuffle.partitions=${SHUFFLE_PARTITIONS:-8}" \
  --conf "spark.redaction.regex=(?i)secret|password|token|access[.]?key|credential|redis_url" \
  local:///opt/idem/idem_job.py "$@"
