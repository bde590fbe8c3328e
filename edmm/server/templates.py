"""Client-supplied chat templates, rendered in a sandbox with a budget.

A chat template sent in ``chat_template_kwargs.chat_template`` is untrusted code: Jinja's
`ImmutableSandboxedEnvironment` keeps it away from Python's internals, but not from spending
minutes of CPU or gigabytes of memory (two nested ``range(100000)`` loops). A thread cannot be
killed, so the budget is enforced from inside the render: the template's AST is rewritten so
that every ``{% for %}`` iterates through a counting iterator, ``~`` concatenations are
size-checked, and every call, attribute lookup, arithmetic operator and output chunk checks the
deadline. Going over any limit raises `TemplateBudgetError` (a 400 for that request alone).

What stays unchecked is bounded by the request itself: the built-in filters run on values that
are at most `TemplateLimits.max_chars` long (the ones that take a size argument are checked).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.defaults import DEFAULT_FILTERS
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from edmm.server.errors import BadRequestError

_LOOP = "__edmm_loop__"
_SIZED = "__edmm_sized__"
_MAX_INT_BITS = 4096  # integers past this many bits are not arithmetic a chat template needs
# str methods that build a string of a size given by an argument (a memory bomb in one call)
_AMPLIFYING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "format",
                                 "format_map"})


@dataclass(frozen=True)
class TemplateLimits:
    """The budget of one client template render.

    Attributes:
        time_s: wall time of the render.
        max_chars: the rendered text and any string or list the template builds.
        max_iterations: loop iterations over the whole render (all loops together).
        max_source_chars: the template's own length.
    """

    time_s: float = 1.0
    max_chars: int = 8 << 20
    max_iterations: int = 1_000_000
    max_source_chars: int = 200_000


class TemplateBudgetError(BadRequestError):
    """A client chat template went over its `TemplateLimits` (400)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"the chat template exceeded its budget: {message}",
                         param="chat_template_kwargs", code="chat_template_budget_exceeded")


class _OverBudget(Exception):
    """Raised inside the render (not a Jinja error, so no template can catch it)."""


class _Budget:
    """What is left of one render's limits."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.time_s
        self.iterations = limits.max_iterations

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"rendering took over {self.limits.time_s:g} s")

    def size(self, n: int) -> None:
        if n > self.limits.max_chars:
            raise _OverBudget(f"a value of {n} characters, over {self.limits.max_chars}")

    def loop(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self.iterations -= 1
            if self.iterations < 0:
                raise _OverBudget(f"over {self.limits.max_iterations} loop iterations")
            self.tick()
            yield item

    def checked(self, value: Any) -> Any:
        if isinstance(value, str | list | tuple | dict):
            self.size(len(value))
        elif isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise _OverBudget(f"an integer over {_MAX_INT_BITS} bits")
        return value


class _BudgetEnvironment(ImmutableSandboxedEnvironment):
    """A sandbox whose calls, lookups and operators spend one render's `_Budget`."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "//", "/"})

    def __init__(self, budget: _Budget) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols])
        self.budget = budget
        self.globals.pop("lipsum", None)
        self.globals.update({
            "range": self._range, "namespace": _sized_namespace(budget),
            "raise_exception": _raise_exception, "strftime_now": _strftime_now,
            _LOOP: budget.loop, _SIZED: budget.checked})
        self.filters.update({
            "tojson": self._tojson, "center": self._width_filter("center"),
            "indent": self._indent, "join": self._join, "replace": self._replace,
            "slice": self._slice, "format": self._format})

    # -------------------------------------------------------------- sandbox hooks
    def call(__self, __context: Any, __obj: Any, *args: Any,  # Jinja's signature
             **kwargs: Any) -> Any:
        budget = __self.budget
        budget.tick()
        for value in (*args, *kwargs.values()):
            budget.checked(value)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            __self._check_str_method(owner, getattr(__obj, "__name__", ""), args)
        return budget.checked(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.budget.tick()
        if isinstance(obj, str) and attribute in _AMPLIFYING_METHODS:
            return self.unsafe_undefined(obj, attribute)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.budget.tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = self.budget
        budget.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    budget.size(len(seq) * max(n, 0))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and max(left.bit_length(), 1) * right > _MAX_INT_BITS:
                raise _OverBudget(f"an integer over {_MAX_INT_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            budget.size(len(left) + _format_width(left))
        return budget.checked(self.binop_table[operator](left, right))

    # -------------------------------------------------------------- budgeted builtins
    def _range(self, *args: int) -> Iterator[int]:
        self.budget.tick()
        return self.budget.loop(range(*args))

    def _check_str_method(self, s: str, name: str, args: tuple[Any, ...]) -> None:
        if name == "replace" and len(args) >= 2:
            self.budget.size(_replace_bound(s, str(args[0]), str(args[1])))
        elif name == "join" and args:
            items = list(args[0]) if not isinstance(args[0], list | tuple) else args[0]
            self.budget.size(len(s) * len(items))

    def _tojson(self, x: Any, ensure_ascii: bool = False, indent: int | None = None,
                separators: Any = None, sort_keys: bool = False) -> str:
        if indent is not None and not 0 <= int(indent) <= 64:
            raise _OverBudget("tojson indent over 64")
        return self.budget.checked(json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                              separators=separators, sort_keys=sort_keys))

    def _width_filter(self, name: str) -> Callable[..., Any]:
        original = self.filters[name]

        def run(value: Any, width: int = 80, *args: Any, **kwargs: Any) -> Any:
            self.budget.size(int(width))
            return self.budget.checked(original(value, width, *args, **kwargs))
        return run

    def _indent(self, s: str, width: int | str = 4, *args: Any, **kwargs: Any) -> Any:
        w = len(width) if isinstance(width, str) else int(width)
        self.budget.size(len(str(s)) + w * (str(s).count("\n") + 1))
        return self.budget.checked(DEFAULT_FILTERS["indent"](s, width, *args, **kwargs))

    @jinja2.pass_eval_context
    def _join(self, eval_ctx: Any, value: Iterable[Any], d: str = "",
              attribute: Any = None) -> Any:
        items = list(value)
        self.budget.size(len(d) * len(items))
        return self.budget.checked(DEFAULT_FILTERS["join"](eval_ctx, items, d, attribute))

    @jinja2.pass_eval_context
    def _replace(self, eval_ctx: Any, s: str, old: str, new: str,
                 count: int | None = None) -> Any:
        self.budget.size(_replace_bound(str(s), str(old), str(new)))
        return self.budget.checked(DEFAULT_FILTERS["replace"](eval_ctx, s, old, new,
                                                                    count))

    def _slice(self, value: Any, slices: int, fill_with: Any = None) -> Any:
        self.budget.size(int(slices))
        return DEFAULT_FILTERS["slice"](value, slices, fill_with)

    def _format(self, value: str, *args: Any, **kwargs: Any) -> Any:
        self.budget.size(len(value) + _format_width(value))
        return self.budget.checked(DEFAULT_FILTERS["format"](value, *args, **kwargs))

    # -------------------------------------------------------------- compile
    def compile_budgeted(self, source: str) -> jinja2.Template:
        """The template of ``source`` with its loops and concatenations budgeted."""
        tree = _Budgeter().visit(self.parse(source))
        tree.set_environment(self)
        return self.from_string(tree)


class _Budgeter(NodeTransformer):
    """Rewrites a template's AST: loops iterate through ``__edmm_loop__`` (counted), ``~``
    concatenations pass through ``__edmm_sized__`` (size-checked)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _wrap(_LOOP, node.iter)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _wrap(_SIZED, node)


def _wrap(name: str, node: nodes.Node) -> nodes.Call:
    call = nodes.Call(nodes.Name(name, "load"), [node], [], None, None)
    call.set_lineno(node.lineno or 1)
    return call


def render_client_template(source: Any, variables: dict[str, Any],
                           limits: TemplateLimits) -> str:
    """Render a client's chat template ``source`` with ``variables`` within ``limits``.

    Raises:
        BadRequestError: the source is not a string, does not compile, or fails while it
            renders (any error: the template is the client's code).
        TemplateBudgetError: the render went over ``limits``.
    """
    if not isinstance(source, str) or not source:
        raise BadRequestError("chat_template must be a non-empty string",
                              param="chat_template_kwargs")
    if len(source) > limits.max_source_chars:
        raise BadRequestError(f"chat_template is over {limits.max_source_chars} characters",
                              param="chat_template_kwargs")
    budget = _Budget(limits)
    env = _BudgetEnvironment(budget)
    try:
        template = env.compile_budgeted(source)
        out: list[str] = []
        size = 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            budget.size(size)
            budget.tick()
            out.append(chunk)
    except _OverBudget as e:
        raise TemplateBudgetError(str(e)) from None
    except RecursionError:
        raise TemplateBudgetError("too deep recursion") from None
    except Exception as e:  # the client's code failed: its error, not the server's
        raise BadRequestError(f"the chat template failed: {type(e).__name__}: {e}",
                              param="chat_template_kwargs") from None
    return "".join(out)


def _sized_namespace(budget: _Budget) -> Callable[..., Namespace]:
    """``namespace(...)`` whose attributes are size-checked when assigned."""

    class SizedNamespace(Namespace):
        def __setitem__(self, name: str, value: Any) -> None:
            budget.tick()
            super().__setitem__(name, budget.checked(value))

    return SizedNamespace


def _replace_bound(s: str, old: str, new: str) -> int:
    """An upper bound of ``len(s.replace(old, new))``."""
    if not old:
        return len(s) + (len(s) + 1) * len(new)
    return len(s) + (len(s) // len(old)) * max(len(new) - len(old), 0)


def _format_width(fmt: str) -> int:
    """The sum of the widths and precisions a ``%`` format asks for (a ``*`` counts as
    unbounded)."""
    total = 0
    for width, precision in re.findall(r"%[-+ #0]*(\d+|\*)?(?:\.(\d+|\*))?", fmt):
        for part in (width, precision):
            if part == "*":
                return 1 << 62
            if part:
                total += int(part[:20])
    return total


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
