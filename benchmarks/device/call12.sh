# Device call 12 (carry nothing; any machine with call 9's web stack and model folder): where
# edmm serve's time goes in the fleet of calls 10-11 at 16 sessions, EDMM alone (no vLLM
# needed): each request's stages (EDMM_STAGE_LOG: validated, rendered, tokenized, submitted,
# scheduled, first output, first event; agents-http-stages.*); then two ablations of the
# defaults: --no-grammar-fast-forward (a forced call's wrapper decoded one step a token, as
# before a6fcd07) and --admission arrival (first come, first served per turn, as vLLM; the
# default "program" puts a new session's first turn behind older sessions' turns).
source benchmarks/device/lib.sh
R=/tmp/res12; mkdir -p $R
timeout 190 python3 -m benchmarks.scripts.fleet_http_peers --out $R/stages --loads 16 \
    --peers "" $FLEET_ARGS --trace-arg=--http-stages 2>&1 | grep -v "^\[" | tail -8
pack res12 call12
timeout 180 python3 -m benchmarks.scripts.fleet_http_peers --out $R/no-ff --loads 16 \
    --peers "" $FLEET_ARGS --trace-arg=--server-arg=--no-grammar-fast-forward 2>&1 \
    | grep -v "^\[" | tail -8
pack res12 call12
timeout 180 python3 -m benchmarks.scripts.fleet_http_peers --out $R/arrival --loads 16 \
    --peers "" $FLEET_ARGS --trace-arg=--server-arg=--admission=arrival 2>&1 \
    | grep -v "^\[" | tail -8
pack res12 call12
