# Device call 12 (carry nothing; any machine with calls 9's web stack and model folder): where
# edmm serve's time goes in the fleet of calls 10-11 at 16 sessions: each request's stages
# (EDMM_STAGE_LOG: validated, rendered, tokenized, submitted, scheduled, first output, first
# event; agents-http-stages.*), then the same run with --no-grammar-fast-forward (a forced
# call's wrapper decoded one step a token, as before a6fcd07). EDMM alone, no vLLM needed.
source benchmarks/device/lib.sh
R=/tmp/res12; mkdir -p $R
timeout 280 python3 -m benchmarks.scripts.fleet_http_peers --out $R/stages --loads 16 \
    --peers "" $FLEET_ARGS --trace-arg=--http-stages 2>&1 | grep -v "^\[" | tail -12
pack res12 call12
timeout 280 python3 -m benchmarks.scripts.fleet_http_peers --out $R/no-ff --loads 16 \
    --peers "" $FLEET_ARGS --trace-arg=--server-arg=--no-grammar-fast-forward 2>&1 \
    | grep -v "^\[" | tail -12
pack res12 call12
