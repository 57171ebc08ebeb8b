#!/bin/bash
# throughput of verify --processes N on Redis (private 6391) and PostgreSQL; Redis engine CPU from /proc
# Usage: redis-server --port 6391 --save "" --appendonly no --daemonize yes --pidfile /tmp/r6391.pid; REDIS_PIDFILE=/tmp/r6391.pid DEDUP=./dedup scripts/verify-processes-throughput.sh (under /tmp/bench on the shared machine)
rpid=$(cat ${REDIS_PIDFILE:?pid file of a private redis-server on 127.0.0.1:6391})
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
for round in 1 2; do
for n in 1 2 4; do
  c0=$(cpu $rpid); t0=$(date +%s.%N)
  out=$(${DEDUP:-dedup} verify --processes $n --store redis --addr 127.0.0.1:6391 --kill-every 0 --messages 20000 --consumers 8 --dup-rate 0 --crash-rate 0 --fail-rate 0 --quiet --json)
  t1=$(date +%s.%N); c1=$(cpu $rpid)
  echo "round $round redis procs=$n $(grep -E '"throughput"|"ok"' <<<"$out" | tr -d ' \n') wall=$(echo "$t1-$t0"|bc) redis_cpu_s=$(echo "($c1-$c0)/100"|bc -l | cut -c1-5)"
  out=$(${DEDUP:-dedup} verify --processes $n --store postgres --kill-every 0 --messages 20000 --consumers 8 --dup-rate 0 --crash-rate 0 --fail-rate 0 --quiet --json)
  echo "round $round postgres procs=$n $(grep -E '"throughput"|"ok"' <<<"$out" | tr -d ' \n')"
done; done
uptime
