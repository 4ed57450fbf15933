#!/usr/bin/env bash
# Resolve with Maven the JVM jars a Spark job running idem needs beside Spark itself
# (Delta Lake's Spark jars, Spark's Kafka connector; see pom.xml here) and copy them
# into one directory, for spark.jars or spark-submit --jars:
#
#   deploy/jars/fetch.sh [DIR]    # default: ${IDEM_JAR_CACHE:-~/.cache/idem/jars}/spark
#
# Jars the Spark installation already ships (same artifact, any version) are left
# out, so a job never has two copies of a library on its classpath. The reference
# is $SPARK_HOME/jars, or the jars of the installed pyspark package.
# A second run with an unchanged pom.xml does nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-${IDEM_JAR_CACHE:-$HOME/.cache/idem/jars}/spark}
stamp="$out/.pom.sha256"
want=$(sha256sum "$here/pom.xml" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

if [ -n "${SPARK_HOME:-}" ] && [ -d "$SPARK_HOME/jars" ]; then
  spark_jars="$SPARK_HOME/jars"
else
  spark_jars=$(python3 -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')
fi
[ -d "$spark_jars" ] || { echo "fetch.sh: no Spark jars at $spark_jars (set SPARK_HOME or install pyspark)" >&2; exit 2; }

command -v mvn >/dev/null 2>&1 || { echo "fetch.sh: Maven (mvn) is needed: apt-get install maven" >&2; exit 2; }
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
echo "resolving Spark-side jars with Maven into $out" >&2
mvn -q -B -Dstyle.color=never -f "$here/pom.xml" dependency:copy-dependencies \
  -DincludeScope=runtime -DoutputDirectory="$staging" >&2

artifact() { basename "$1" .jar | sed -E 's/-[0-9][0-9A-Za-z.]*(-[0-9A-Za-z.]+)?$//'; }
declare -A shipped=()
for jar in "$spark_jars"/*.jar; do shipped[$(artifact "$jar")]=1; done
mkdir -p "$out"
rm -f "$out"/*.jar
for jar in "$staging"/*.jar; do
  [ -n "${shipped[$(artifact "$jar")]:-}" ] || cp "$jar" "$out/"
done
echo "$want" > "$stamp"
ls "$out" >&2
