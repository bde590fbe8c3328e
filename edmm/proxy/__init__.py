"""``edmm proxy``: an OpenAI-compatible proxy that gives vLLM EDMM's speculative prefill.

    edmm proxy --upstream http://127.0.0.1:8000 --port 8001

It tags chat requests with agent-session ``kv_transfer_params`` for EDMM's vLLM KV connector
(`edmm.integrations.vllm`), and when a response ends in tool calls it prefills the next
prompt's head (up to the first tool result) in vLLM while the tool runs. See `edmm.proxy.app`.
"""

from edmm.proxy.app import Proxy, ProxyConfig, ProxyError, build_app
from edmm.proxy.speculation import StreamAccumulator, speculation_prompt

__all__ = ["Proxy", "ProxyConfig", "ProxyError", "StreamAccumulator", "build_app",
           "speculation_prompt"]
