# Device call 15 (carry nothing; any machine with call 9's web stack and model folder and
# vLLM installed by call 10 or 17: its bundle also brings the openai SDK the clients need): one point of the fleet of calls 10-13, chosen by the
# environment: LOAD sessions (default 8), JOBS top-level jobs (default 24: raise it with the
# load, ~3 a session), EDMM's POLICIES (default edmm; none: EDMM not run; lru,offload: the
# rebuilt baselines, to hold against vLLM APC and + offload of calls 10 and 13 on one trace)
# and PEERS (default none; vllm or vllm-offload: one vLLM start each, ~110 s). Results under
# /tmp/res15/fleet-$LOAD-$POLICIES-$PEERS, merged later with `edmm bench agents-merge` (only
# points of one JOBS share a trace: a knee's load points need the same JOBS).
# LOAD may list several points (LOAD=16,32: lowest first; the next starts only when the last
# one's time says it ends within T_FLEET, default 560 s, the call's limit).
# SERVER_ARGS: more edmm serve flags for EDMM's policies (e.g. "--busy-spec-tokens=32"), with
# TAG naming the variant's folder (fleet-$LOAD-$POLICIES-$PEERS$TAG) beside the default one.
# E.g. POLICIES=lru,offload bash ...call15.sh; LOAD=32 JOBS=96 bash ...; LOAD=32 JOBS=96
# POLICIES=none PEERS=vllm bash ...; SERVER_ARGS=--busy-spec-tokens=32 TAG=-busy32 bash ...
source benchmarks/device/lib.sh
R=/tmp/res15; mkdir -p $R
T_FLEET=${T_FLEET:-560}
NAME=fleet-${LOAD:-8}-${POLICIES:-edmm}-${PEERS:-none}${TAG:-}
SERVER=(); for a in ${SERVER_ARGS:-}; do SERVER+=("--trace-arg=--server-arg=$a"); done
timeout $T_FLEET python3 -m benchmarks.scripts.fleet_http_peers --budget-s $((T_FLEET - 30)) \
    --out $R/$NAME --loads ${LOAD:-8} \
    --policies ${POLICIES:-edmm} --peers "${PEERS:-}" --trace-arg=--jobs=${JOBS:-24} \
    --trace-arg=--time-scale=0.05 "${SERVER[@]}" > $R/$NAME.log 2>&1
grep -v "^\[\|^INFO\|^(APIServer\|^(EngineCore" $R/$NAME.log | tail -25
pack res15 call15
