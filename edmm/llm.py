"""Offline inference, following vLLM: ``LLM(model).generate(prompts, SamplingParams(...))``.

    from edmm import LLM, SamplingParams
    llm = LLM()  # the embedded tool model on the CPU
    out = llm.generate(["Hello", "The capital of France is"], SamplingParams(temperature=0))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias, cast

import torch

from edmm.agent.render import template_view
from edmm.engine.config import EngineConfig
from edmm.engine.engine import Engine, Request
from edmm.engine.errors import InvalidRequestError
from edmm.engine.outputs import RequestOutput
from edmm.engine.sampling import SamplingParams
from edmm.engine.tp import build_engine

# A prompt: text, or {"prompt_token_ids": [...]} (optionally with "prompt": its text), or
# {"prompt": "..."}.
PromptType: TypeAlias = str | Mapping[str, Any]
Message: TypeAlias = Mapping[str, Any]


class LLM:
    """An engine for offline batches: every prompt in, every completion out, in order.

    Args:
        model: a local HF folder or a preset name; None: the embedded tool model.
        tokenizer: a tokenizer folder; None: the model folder's.
        device: ``"cpu"`` or ``"cuda"``.
        dtype: weights and KV dtype; None: the model config's.
        seed: seed of the shared sampling stream.
        tensor_parallel_size: ranks to split the model over (one process each, spawned here;
            on CUDA rank ``r`` runs on ``cuda:r``); 1: this process alone.
        **engine_kwargs: any other `EngineConfig` field (``num_pages``, ``max_model_len``,
            ``max_num_batched_tokens``, ``enable_prefix_caching``, ``backend``, ...).
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 device: str = "cpu", dtype: str | torch.dtype | None = None,
                 seed: int | None = 0, tensor_parallel_size: int = 1,
                 **engine_kwargs: Any) -> None:
        config = EngineConfig(model=model, tokenizer=tokenizer, device=device, dtype=dtype,
                              seed=seed, tensor_parallel_size=tensor_parallel_size,
                              **engine_kwargs)
        self.llm_engine: Engine = build_engine(config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        """The HF tokenizer (None for a preset without one)."""
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; one finished `RequestOutput` per prompt, in order.

        Every prompt is validated before any is scheduled: a bad one raises
        `InvalidRequestError` and nothing runs.
        """
        items = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        params = self._params_for(items, sampling_params)
        return self._run([self._make(p, sp) for p, sp in zip(items, params, strict=True)])

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to several, rendered
        with the tokenizer's chat template (``tools`` are passed to it)."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer with a chat template")
        convs = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts: list[PromptType] = []
        for conv in convs:
            text = tokenizer.apply_chat_template(
                template_view(tokenizer, cast(Sequence[Mapping[str, Any]], conv)), tools=tools,
                add_generation_prompt=add_generation_prompt, tokenize=False,
                **(chat_template_kwargs or {}))
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params)

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache entry; return how many."""
        return self.llm_engine.reset_prefix_cache()

    def close(self) -> None:
        """Release the engine's KV memory."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _make(self, prompt: PromptType, params: SamplingParams) -> Request:
        request_id = str(next(self._ids))
        if isinstance(prompt, str):
            return self.llm_engine.make_request(request_id, prompt, params)
        if not isinstance(prompt, Mapping):
            raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}")
        if "prompt_token_ids" in prompt:
            req = self.llm_engine.make_request(request_id, prompt["prompt_token_ids"], params)
            return dataclasses.replace(req, prompt=prompt.get("prompt"))
        if "prompt" in prompt:
            return self.llm_engine.make_request(request_id, prompt["prompt"], params)
        raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")

    @staticmethod
    def _params_for(items: list[PromptType],
                    params: SamplingParams | Sequence[SamplingParams] | None,
                    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in items]
        if isinstance(params, SamplingParams):
            return [params] * len(items)
        if len(params) != len(items):
            raise InvalidRequestError(
                f"{len(params)} sampling params for {len(items)} prompts")
        return list(params)

    def _run(self, requests: list[Request]) -> list[RequestOutput]:
        engine = self.llm_engine
        final: dict[str, RequestOutput] = {}
        for req in requests:
            engine.submit(req)
        try:
            while len(final) < len(requests):
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for req in requests:
                engine.abort(req.request_id)
            raise
        return [final[req.request_id] for req in requests]
