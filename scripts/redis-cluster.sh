#!/usr/bin/env bash
# Starts (or stops) a local Redis Cluster.
#
#   scripts/redis-cluster.sh start|stop             3 masters, no replicas, on
#       127.0.0.1:7000-7002: the cluster the redisstore tests use.
#   scripts/redis-cluster.sh start|stop --replicas  3 masters with 1 replica
#       each on 127.0.0.1:7100-7105: the cluster that `dedup verify
#       --failover-every` fails over and kills nodes of. Its own ports, so
#       that killing its nodes never disturbs the tests on 7000-7002.
#
# Idempotent: a cluster that is already healthy (cluster_state:ok and, with
# --replicas, every replica linked to its master and done syncing) is left
# as it is; start returns only once it is healthy. Each node runs from a
# config file in $DEDUP_REDIS_CLUSTER_DIR/<port>/redis.conf (default dir
# /tmp/dedup-redis-cluster, or /tmp/dedup-redis-cluster-replicas), so that a
# node killed mid-run can be started again with `redis-server <that file>`
# (INFO server names it as config_file); it rejoins as a replica of the
# node that was promoted in its place.
set -euo pipefail

cmd=${1:-start}
replicas=0
if [ "${2:-}" = --replicas ]; then
	replicas=1
elif [ -n "${2:-}" ]; then
	echo "usage: $0 start|stop [--replicas]" >&2
	exit 2
fi
if [ "$replicas" = 1 ]; then
	ports=(7100 7101 7102 7103 7104 7105)
	base=${DEDUP_REDIS_CLUSTER_DIR:-/tmp/dedup-redis-cluster-replicas}
else
	ports=(7000 7001 7002)
	base=${DEDUP_REDIS_CLUSTER_DIR:-/tmp/dedup-redis-cluster}
fi
want_masters=3

cli() { redis-cli -p "$1" "${@:2}" 2>/dev/null | tr -d '\r'; }

# healthy: every node says cluster_state:ok, there are 3 masters with
# slots and, with --replicas, 3 replicas whose link is up and whose sync is
# done.
healthy() {
	local p info masters=0 synced=0
	for p in "${ports[@]}"; do
		[ "$(cli "$p" cluster info | sed -n 's/^cluster_state://p')" = ok ] || return 1
		info=$(cli "$p" info replication)
		case "$info" in
		*role:master*) masters=$((masters + 1)) ;;
		*role:slave*)
			grep -q '^master_link_status:up' <<<"$info" || return 1
			grep -q '^master_sync_in_progress:0' <<<"$info" || return 1
			synced=$((synced + 1))
			;;
		*) return 1 ;;
		esac
	done
	[ "$masters" = "$want_masters" ] && [ "$synced" = $((replicas * want_masters)) ]
}

stop() {
	local p pid
	for p in "${ports[@]}"; do
		redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true
		# A node that does not answer (stopped, hung) goes by its pid file.
		if [ -f "$base/$p/redis.pid" ]; then
			pid=$(cat "$base/$p/redis.pid")
			kill -9 "$pid" 2>/dev/null || true
		fi
	done
	rm -rf "$base"
}

case "$cmd" in
stop)
	stop
	;;
start)
	if healthy; then
		echo "redis cluster already up on ${ports[*]}"
		exit 0
	fi
	command -v redis-server >/dev/null || { echo "redis-server is not installed (apt-get install redis-server)" >&2; exit 1; }
	stop
	for p in "${ports[@]}"; do
		mkdir -p "$base/$p"
		cat >"$base/$p/redis.conf" <<EOF
port $p
bind 127.0.0.1
dir $base/$p
cluster-enabled yes
cluster-config-file nodes.conf
cluster-node-timeout 2000
cluster-replica-validity-factor 0
repl-diskless-sync yes
repl-diskless-sync-delay 0
save ""
appendonly no
daemonize yes
pidfile $base/$p/redis.pid
logfile $base/$p/redis.log
EOF
		redis-server "$base/$p/redis.conf"
	done
	for p in "${ports[@]}"; do
		for _ in $(seq 1 50); do redis-cli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
	done
	nodes=()
	for p in "${ports[@]}"; do nodes+=("127.0.0.1:$p"); done
	redis-cli --cluster create "${nodes[@]}" --cluster-replicas "$replicas" --cluster-yes >/dev/null
	for _ in $(seq 1 300); do
		if healthy; then
			echo "redis cluster up on ${ports[*]}"
			exit 0
		fi
		sleep 0.2
	done
	echo "redis cluster did not become healthy (cluster_state:ok, replicas in sync); see $base/*/redis.log" >&2
	exit 1
	;;
*)
	echo "usage: $0 start|stop [--replicas]" >&2
	exit 2
	;;
esac
