"""Agent sessions: tool-call pause/resume, speculative prefill in the tool window, zero-copy
commit."""

from edmm.agent.api import AgentEngine
from edmm.agent.errors import (
    AgentError,
    InsertionPositionError,
    QuotaExceededError,
    SessionStateError,
    ToolOutputClosedError,
    UnknownPolicyError,
    UnknownSessionError,
    UnknownToolCallError,
)
from edmm.agent.owners import KeyQuota, OwnerStats
from edmm.agent.render import assistant_message
from edmm.agent.types import (
    AgentConfig,
    AgentStats,
    SessionMetrics,
    SessionState,
    SessionTag,
    TagKind,
    TokenLayout,
    ToolCall,
    ToolContent,
    ToolResult,
    ToolSpec,
)

__all__ = [
    "AgentConfig",
    "AgentEngine",
    "AgentError",
    "AgentStats",
    "InsertionPositionError",
    "KeyQuota",
    "OwnerStats",
    "QuotaExceededError",
    "SessionMetrics",
    "SessionState",
    "SessionStateError",
    "SessionTag",
    "TagKind",
    "TokenLayout",
    "ToolCall",
    "ToolContent",
    "ToolOutputClosedError",
    "ToolResult",
    "ToolSpec",
    "UnknownPolicyError",
    "UnknownSessionError",
    "UnknownToolCallError",
    "assistant_message",
]
