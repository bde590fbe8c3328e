# Device call 2 (carry: .carry/half01): vLLM's first part joined from the two halves.
mkdir -p /tmp/vllm-wheels
cat /tmp/vp/half00 .carry/half01 > /tmp/vllm-wheels/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl.xz.part00
sha256sum /tmp/vllm-wheels/*.part00 | cut -c1-16; rm /tmp/vp/half00
