#!/usr/bin/env bash
# Starts (or stops) a 3-master Redis Cluster on 127.0.0.1:7000-7002 for the
# redisstore cluster tests. Idempotent: an already healthy cluster is left
# as it is. Usage: scripts/redis-cluster.sh start|stop
set -euo pipefail
ports=(7000 7001 7002)
base=${DEDUP_REDIS_CLUSTER_DIR:-/tmp/dedup-redis-cluster}

state() { redis-cli -p "${ports[0]}" cluster info 2>/dev/null | tr -d '\r' | sed -n 's/^cluster_state://p'; }

case "${1:-start}" in
stop)
	for p in "${ports[@]}"; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
	rm -rf "$base"
	;;
start)
	if [ "$(state)" = ok ]; then
		echo "redis cluster already up on ${ports[*]}"
		exit 0
	fi
	command -v redis-server >/dev/null || { echo "redis-server is not installed (apt-get install redis-server)" >&2; exit 1; }
	for p in "${ports[@]}"; do
		redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true
	done
	rm -rf "$base"
	for p in "${ports[@]}"; do
		mkdir -p "$base/$p"
		redis-server --port "$p" --bind 127.0.0.1 --cluster-enabled yes \
			--cluster-config-file "$base/$p/nodes.conf" --cluster-node-timeout 2000 \
			--repl-diskless-sync-delay 0 --save "" --appendonly no --dir "$base/$p" \
			--daemonize yes --logfile "$base/$p/redis.log"
	done
	for p in "${ports[@]}"; do
		for _ in $(seq 1 50); do redis-cli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
	done
	redis-cli --cluster create 127.0.0.1:7000 127.0.0.1:7001 127.0.0.1:7002 --cluster-replicas 0 --cluster-yes >/dev/null
	for _ in $(seq 1 100); do
		if [ "$(state)" = ok ]; then
			echo "redis cluster up on ${ports[*]}"
			exit 0
		fi
		sleep 0.2
	done
	echo "redis cluster did not reach cluster_state:ok; see $base/*/redis.log" >&2
	exit 1
	;;
*)
	echo "usage: $0 start|stop" >&2
	exit 2
	;;
esac
