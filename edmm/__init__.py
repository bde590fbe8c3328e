"""EDMM: Execution-Driven Memory Management for LLM agent tool-call loops."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from edmm.engine.sampling import SamplingParams
    from edmm.llm import LLM


def __getattr__(name: str) -> Any:
    """Import ``LLM`` and ``SamplingParams`` on first use (keeps ``import edmm`` light)."""
    if name == "LLM":
        from edmm.llm import LLM

        return LLM
    if name == "SamplingParams":
        from edmm.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'edmm' has no attribute {name!r}")
