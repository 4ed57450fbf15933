#!/usr/bin/env bash
# Resolve with Maven the JVM jars the tests need into a cache outside the repository:
#   <cache>/spark         Delta's Spark jars and Spark's Kafka connector (deploy/jars/fetch.sh)
#   <cache>/kafka-broker  a Kafka broker run in KRaft mode by tests/kafka_broker.py
# <cache> is ${IDEM_JAR_CACHE:-~/.cache/idem/jars}. A run with unchanged poms does nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${IDEM_JAR_CACHE:-$HOME/.cache/idem/jars}
bash "$here/../../deploy/jars/fetch.sh" "$cache/spark"

out="$cache/kafka-broker"
want=$(sha256sum "$here/pom.xml" | cut -d' ' -f1)
if [ -f "$out/.pom.sha256" ] && [ "$(cat "$out/.pom.sha256")" = "$want" ]; then exit 0; fi
echo "resolving the Kafka broker's jars with Maven into $out" >&2
rm -rf "$out"
mvn -q -B -Dstyle.color=never -f "$here/pom.xml" dependency:copy-dependencies \
  -DincludeScope=runtime -DoutputDirectory="$out" >&2
echo "$want" > "$out/.pom.sha256"
