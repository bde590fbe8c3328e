"""EDMM: Execution-Driven Memory Management for LLM agent tool-call loops."""

__version__ = "0.1.0"
