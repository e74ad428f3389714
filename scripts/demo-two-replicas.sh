#!/usr/bin/env bash
# Two `serve` replicas sharing contexts through Redis, behind HAProxy (default) or nginx.
#
#   scripts/demo-two-replicas.sh [MODEL] [--nginx] [--round-robin]
#
# Starts redis-server on 127.0.0.1:6390 (a temporary directory, appendonly), replicas on 8081 and
# 8082 (`--context-store redis://127.0.0.1:6390`), the balancer on 8080 with
# configs/haproxy-two-replicas.cfg or configs/nginx-two-replicas.conf; then creates a context
# through the balancer, makes 3 calls through it (sticky: one replica) and one directly on each
# replica (the conversation continues on either: a replica without the context's latest state
# takes it from the store), printing after each call the context's revision and tokens. Fails
# unless every call answers 200 and the revision counts 1, 2, 3, … Everything it started is
# stopped on exit. --round-robin: the same balancer config without the hash on context routes
# (it works too: each call's replica takes the context from the store, a switch-in per call).
#
# MODEL: default ../shared/models/stories260K-f32.gguf. SERVE_ARGS: more `serve` options
# (default `--device cpu --threads 2`). GPU_OFFLOAD_BIN: the binary (default
# target/release/gpu-offload, built when missing). Needs redis-server (or valkey-server), curl,
# jq, and haproxy or nginx.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

BALANCER=haproxy
STICKY=1
MODEL=../shared/models/stories260K-f32.gguf
for a in "$@"; do
    case "$a" in
        --nginx) BALANCER=nginx ;;
        --haproxy) BALANCER=haproxy ;;
        --round-robin) STICKY=0 ;;
        -h | --help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown option $a" >&2; exit 2 ;;
        *) MODEL=$a ;;
    esac
done
read -r -a SERVE_ARGS <<<"${SERVE_ARGS:---device cpu --threads 2}"
BIN=${GPU_OFFLOAD_BIN:-target/release/gpu-offload}
REDIS_PORT=6390
LB=http://127.0.0.1:8080
R1=http://127.0.0.1:8081
R2=http://127.0.0.1:8082

die() { echo "demo: $*" >&2; exit 1; }
[ -f "$MODEL" ] || die "no model at $MODEL"
REDIS=$(command -v redis-server || command -v valkey-server) ||
    die "needs redis-server or valkey-server (scripts/install-redis.sh)"
command -v "$BALANCER" >/dev/null || die "needs $BALANCER (apt-get install $BALANCER)"
for t in curl jq; do command -v $t >/dev/null || die "needs $t"; done
for p in $REDIS_PORT 8080 8081 8082; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then die "port $p is in use"; fi
done
if [ ! -x "$BIN" ]; then cargo build --release; fi

WORK=$(mktemp -d /tmp/gpu-offload-demo.XXXXXX)
PIDS=()
cleanup() {
    local rc=$?
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill "${PIDS[i]}" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    if [ $rc != 0 ]; then
        echo "demo: failed; last lines of the logs:" >&2
        tail -n 5 "$WORK"/*.log >&2 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Wait until URL answers 200 (up to 60 s).
wait_http() {
    for _ in $(seq 300); do
        curl -sf -o /dev/null "$1" && return 0
        sleep 0.2
    done
    die "$1 did not come up"
}

mkdir -p "$WORK/redis"
"$REDIS" --bind 127.0.0.1 --port $REDIS_PORT --dir "$WORK/redis" --appendonly yes \
    --appendfsync everysec --save '' >"$WORK/redis.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do
    (exec 3<>/dev/tcp/127.0.0.1/$REDIS_PORT) 2>/dev/null && break
    sleep 0.1
done

for port in 8081 8082; do
    "$BIN" serve -m "$MODEL" "${SERVE_ARGS[@]}" --port $port \
        --context-store redis://127.0.0.1:$REDIS_PORT >"$WORK/replica-$port.log" 2>&1 &
    PIDS+=($!)
done
wait_http $R1/health
wait_http $R2/health

HAPROXY_CFG=$ROOT/configs/haproxy-two-replicas.cfg
NGINX_CONF=$ROOT/configs/nginx-two-replicas.conf
if [ $STICKY = 0 ]; then
    sed 's/^\( *\)balance uri depth 3 path-only$/\1balance roundrobin/' "$HAPROXY_CFG" >"$WORK/haproxy.cfg"
    sed 's/^\( *\)hash \$context_id consistent;$/\1# round robin/' "$NGINX_CONF" >"$WORK/nginx.conf"
    HAPROXY_CFG=$WORK/haproxy.cfg NGINX_CONF=$WORK/nginx.conf
    grep -q 'balance roundrobin' "$HAPROXY_CFG" && grep -q '# round robin' "$NGINX_CONF" ||
        die "could not take the hash out of the configs"
fi
if [ $BALANCER = haproxy ]; then
    haproxy -f "$HAPROXY_CFG" >"$WORK/haproxy.log" 2>&1 &
else
    mkdir -p "$WORK/nginx"
    nginx -c "$NGINX_CONF" -p "$WORK/nginx" -e stderr -g 'daemon off;' >"$WORK/nginx.log" 2>&1 &
fi
PIDS+=($!)
wait_http $LB/health
echo "redis on :$REDIS_PORT, replicas on :8081 and :8082, $BALANCER on :8080" \
    "($([ $STICKY = 1 ] && echo "sticky by context id" || echo "round robin"); logs in $WORK)"

ID=$(curl -sf $LB/v1/contexts -d '{}' | jq -r .id)
echo "created $ID through $BALANCER"

N=0
# call BASE LABEL PROMPT: one completion on the context through BASE, then its revision.
call() {
    local base=$1 label=$2 prompt=$3 code by view rev tokens from_store text
    N=$((N + 1))
    code=$(curl -s -o "$WORK/body" -D "$WORK/head" -w '%{http_code}' \
        "$base/v1/contexts/$ID/completions" \
        -d "$(jq -nc --arg p "$prompt" '{prompt: $p, max_tokens: 16, temperature: 0}')")
    by=$(tr -d '\r' <"$WORK/head" | awk -F': ' 'tolower($1) == "x-served-by" {print $2}')
    [ "$code" = 200 ] || die "call $N ($label): HTTP $code: $(cat "$WORK/body")"
    text=$(jq -r '.choices[0].text' "$WORK/body")
    # The view of the replica that answered: chunks its last switch-in took from the store.
    case "$by" in
        r1) view=$R1 ;;
        r2) view=$R2 ;;
        127.0.0.1:*) view=http://$by ;;
        *) view=$base ;;
    esac
    read -r rev tokens from_store < <(curl -sf "$view/v1/contexts/$ID" |
        jq -r '"\(.revision) \(.tokens) \(.last_restore.chunks_from_store // 0)"')
    printf 'call %d  %-30s 200  revision %-2s tokens %-4s chunks from store %-2s %s\n' "$N" \
        "$label${by:+ ($by)}" "$rev" "$tokens" "$from_store" "$(jq -Rn --arg t "$prompt$text" '$t')"
    [ "$rev" = $N ] || die "call $N: revision $rev, expected $N"
}

call $LB "via $BALANCER" "Once upon a time"
call $LB "via $BALANCER" " The next day,"
call $LB "via $BALANCER" " Then"
call $R1 "direct :8081" " One morning,"
call $R2 "direct :8082" " At last,"

echo "GET /v1/contexts/$ID:"
curl -sf $LB/v1/contexts/$ID | jq -c '{revision, tokens}'
for r in $R1 $R2; do
    echo "${r#http://} store events: $(curl -sf $r/metrics |
        awk '/^gpu_offload_context_store_events_total/ {sub(/.*event="/, ""); sub(/"}/, ""); printf "%s=%s ", $1, $2}')"
done
echo "ok: every call answered 200, revisions 1..$N"
