"""Engine: sequences, the token-budget scheduler, prefix reuse, the model runner, the step loop."""

from edmm.engine.config import EngineConfig
from edmm.engine.engine import Engine, EngineStats, Request, RequestValidator
from edmm.engine.errors import (
    ContextLengthError,
    EngineConfigError,
    EngineError,
    IntegrityError,
    InvalidRequestError,
    SchedulerStallError,
)
from edmm.engine.kv_manager import HeldPages, KVCacheManager, KVLayout, KVStats
from edmm.engine.kv_policy import AdoptionCost
from edmm.engine.outputs import CompletionOutput, RequestOutput, RequestTiming, TokenLogprobs
from edmm.engine.prefix_cache import CacheTag, EntryRank, PrefixCache, PrefixHit
from edmm.engine.runner import ModelInputs, ModelRunner
from edmm.engine.sampling import FinishReason, SamplingParams
from edmm.engine.scheduler import ScheduledBatch, ScheduledSeq, Scheduler, SchedulerConfig
from edmm.engine.sequence import Sequence, SequenceKind, SequenceStatus, SlotHints

__all__ = [
    "AdoptionCost",
    "CacheTag",
    "CompletionOutput",
    "ContextLengthError",
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineError",
    "EngineStats",
    "EntryRank",
    "FinishReason",
    "HeldPages",
    "IntegrityError",
    "InvalidRequestError",
    "KVCacheManager",
    "KVLayout",
    "KVStats",
    "ModelInputs",
    "ModelRunner",
    "PrefixCache",
    "PrefixHit",
    "Request",
    "RequestOutput",
    "RequestTiming",
    "RequestValidator",
    "SamplingParams",
    "ScheduledBatch",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStallError",
    "Sequence",
    "SequenceKind",
    "SequenceStatus",
    "SlotHints",
    "TokenLogprobs",
]
