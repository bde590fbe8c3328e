# Device call 18 (carry nothing; after call 16 or 9 on the same held machine: in process,
# no HTTP client): the fleet of
# call 15 in process (`edmm bench agents` without --http: the same generated trace, seed,
# oversubscription and policies, wall clock), to hold each policy's HTTP result against
# (issue 45: within 10%). LOAD, JOBS, POLICIES as in call 15 (default 8, 24, edmm).
# The same work as over HTTP: call turns decode CALL_TOKENS (default: the call_tokens an HTTP
# run of this machine measured, read from its agents-http.json under /tmp/res15 or
# /tmp/res19) and the rest of their output joins the result (`--call-tokens`); CALL_TOKENS=0:
# the trace's outputs decoded whole (before 2026-12-08: 1.65x the HTTP run's decoded tokens).
source benchmarks/device/lib.sh
R=/tmp/res18; mkdir -p $R
FLEET=$(python3 -c "from benchmarks.scripts.fleet_http_peers import FLEET; print(' '.join(FLEET))")
[ -z "${CALL_TOKENS:-}" ] && CALL_TOKENS=$(python3 -m benchmarks.scripts.call_tokens /tmp/res15 /tmp/res19)
CALLS=(); [ "${CALL_TOKENS:-0}" != 0 ] && CALLS=(--call-tokens "$CALL_TOKENS")
echo "call turns decode: ${CALL_TOKENS:-all of the trace output} tokens"
timeout ${T_FLEET:-540} python3 -m edmm bench agents --model qwen2.5-7b \
    --tokenizer /tmp/qwen25-7b-dummy --device cuda --dtype bfloat16 $FLEET \
    --jobs=${JOBS:-24} --time-scale=0.05 --policies ${POLICIES:-edmm} --loads ${LOAD:-8} \
    --no-checks --clock wall "${CALLS[@]}" --out $R/in-process-${LOAD:-8} 2>&1 | tail -12
pack res18 call18
