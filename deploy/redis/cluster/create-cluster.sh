#!/usr/bin/env bash
# A local Redis Cluster for trying idem: 6 nodes (3 primaries, 3 replicas) on
# 127.0.0.1 only, each started from node.conf.
#
#   deploy/redis/cluster/create-cluster.sh start    # start the nodes, create the cluster
#   deploy/redis/cluster/create-cluster.sh status   # redis-cli --cluster check
#   deploy/redis/cluster/create-cluster.sh stop     # stop the nodes (data is kept)
#
# Environment: BASE_PORT (default 7000; ports BASE_PORT..BASE_PORT+5 and their
# cluster bus ports +10000 must be free), CLUSTER_DIR (default ./idem-cluster).
# A cluster on one host protects nothing: use it to test, not to run.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
base_port=${BASE_PORT:-7000}
cluster_dir=${CLUSTER_DIR:-$PWD/idem-cluster}
nodes=6
replicas=1
host=127.0.0.1

ports() { seq "$base_port" $((base_port + nodes - 1)); }

wait_for() {  # wait_for <port> <what> <command...>: retry for up to 30 s
  local port=$1 what=$2 tries=0
  shift 2
  until "$@" >/dev/null 2>&1; do
    tries=$((tries + 1))
    if [ "$tries" -ge 300 ]; then
      echo "node $port: $what after 30 s; see $cluster_dir/$port/redis.log" >&2
      exit 1
    fi
    sleep 0.1
  done
}

state_ok() { redis-cli -h "$host" -p "$1" cluster info | grep -q '^cluster_state:ok'; }

start() {
  command -v redis-server >/dev/null || { echo "redis-server is not installed" >&2; exit 1; }
  local port
  for port in $(ports); do
    mkdir -p "$cluster_dir/$port"
    redis-server "$here/node.conf" \
      --port "$port" --bind "$host" --dir "$cluster_dir/$port" \
      --cluster-config-file "nodes-$port.conf" \
      --daemonize yes --pidfile "$cluster_dir/$port/redis.pid" \
      --logfile "$cluster_dir/$port/redis.log"
  done
  for port in $(ports); do
    wait_for "$port" "no answer to PING" redis-cli -h "$host" -p "$port" ping
  done
  if state_ok "$base_port"; then
    echo "cluster already created (restarted from $cluster_dir)"
  else
    local addresses=()
    for port in $(ports); do addresses+=("$host:$port"); done
    redis-cli --cluster create "${addresses[@]}" --cluster-replicas "$replicas" --cluster-yes
  fi
  for port in $(ports); do
    wait_for "$port" "cluster_state is not ok" state_ok "$port"
  done
  echo "cluster ready: redis-cli -c -h $host -p $base_port"
}

stop() {
  local port pidfile
  for port in $(ports); do
    pidfile="$cluster_dir/$port/redis.pid"
    if [ -f "$pidfile" ]; then
      kill "$(cat "$pidfile")" 2>/dev/null || true
      # SIGTERM makes the node flush its AOF and exit; wait for the pid file to go.
      for _ in $(seq 100); do [ -f "$pidfile" ] || break; sleep 0.1; done
    fi
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) redis-cli --cluster check "$host:$base_port" ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
