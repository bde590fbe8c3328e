"""Request bodies parsed and validated in one pass, with FastAPI's errors when they are bad.

A resume carries the whole conversation (hundreds of KB at 32K tokens). FastAPI parses a body
parameter with ``json.loads`` into Python objects, then validates those: two passes, the first
in Python objects. `parse_body` hands the bytes to pydantic's ``model_validate_json`` (one pass
in Rust), and only where that cannot stand for FastAPI's route takes FastAPI's own way (same
result, same errors):

- a body that fails the one-pass validation, is empty, or is not sent as JSON (its errors are
  then built as FastAPI builds them: ``RequestValidationError`` with locations under ``body``);
- JSON nested deeper than the one-pass parser's limit (200 levels) is a 400 at once, never
  handed to ``json.loads`` (whose recursion would end in a ``RecursionError``);
- among those, a body whose JSON holds a lone surrogate escape (``"\\ud800"``): the one-pass
  parser refuses it as invalid JSON, ``json.loads`` accepts it, and `check_text` then names it
  (a 400 ``invalid_text``, as before).

`ParsedBody.surrogate_free` says that no string of the request can hold a lone surrogate (it
passed the one-pass parser, which refuses every one; ``tests/server/test_body.py`` checks it),
so `check_text` need not walk it.
"""

from __future__ import annotations

import email.message
import json
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi.exceptions import HTTPException, RequestValidationError
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ParsedBody(Generic[M]):
    """A validated body; ``surrogate_free``: no string in it can hold a lone surrogate."""

    value: M
    surrogate_free: bool


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this ``Content-Type`` as JSON (``application/json``
    or ``application/*+json``, parameters allowed)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def parse_body(model: type[M], body: bytes, content_type: str | None) -> ParsedBody[M]:
    """``body`` validated as ``model``, as FastAPI's route with a ``model`` body parameter
    (strict content type) would validate it.

    Raises:
        RequestValidationError: the body is no valid ``model``, with FastAPI's error list.
    """
    if body and is_json(content_type):
        try:
            return ParsedBody(model.model_validate_json(body), True)
        except ValidationError as e:
            if _too_deep(e):
                raise _nested_too_deeply() from None
            # else the errors are built the way FastAPI builds them
    return ParsedBody(_fastapi_way(model, body, content_type), False)


def _too_deep(error: ValidationError) -> bool:
    """Whether the one-pass parser stopped at its nesting limit (pydantic's JSON parser
    refuses JSON nested deeper than 200 arrays and objects)."""
    return any(e["type"] == "json_invalid" and "recursion limit" in e["msg"]
               for e in error.errors(include_url=False))


def _nested_too_deeply() -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                    "msg": "JSON nested too deeply", "input": {}}])


def _fastapi_way(model: type[M], body: bytes, content_type: str | None) -> M:
    """FastAPI's body handling: JSON decoded with ``json.loads`` (its errors as
    ``json_invalid``; text that is not Unicode: a plain 400), a body not sent as JSON kept as
    bytes, no body missing."""
    value: object = body
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    if is_json(content_type):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos),
                                           "msg": "JSON decode error", "input": {},
                                           "ctx": {"error": e.msg}}], body=e.doc) from e
        except UnicodeDecodeError as e:  # not UTF-8 (nor UTF-16/32)
            raise HTTPException(status_code=400,
                                detail="There was an error parsing the body") from e
        except RecursionError:  # deeper than Python's stack, which the parser above refused
            raise _nested_too_deeply() from None
    try:  # from attributes, as FastAPI validates a body field (its error for a non-object)
        return model.model_validate(value, from_attributes=True)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])}
                  for err in e.errors(include_url=False)]
        raise RequestValidationError(errors, body=value) from None
