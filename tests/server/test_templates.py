"""Client chat templates in the budgeted sandbox: ordinary templates render as Jinja renders
them; every way to spend minutes or gigabytes stops at its limit with a 400."""

from __future__ import annotations

import json
import time

import jinja2
import pytest

from edmm.server.errors import BadRequestError
from edmm.server.templates import TemplateBudgetError, TemplateLimits, render_client_template

LIMITS = TemplateLimits(time_s=2.0, max_chars=1 << 20, max_iterations=100_000)
VARIABLES = {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "yo"}],
             "tools": [{"type": "function", "function": {"name": "f"}}],
             "add_generation_prompt": True}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("source", [
    pytest.param(CHATML, id="chatml"),
    pytest.param("{% for m in messages %}{{ loop.index }}:{{ m.content ~ '|' }}"
                 "{% if loop.last %}end{% endif %}{% endfor %}", id="loop-vars"),
    pytest.param("{{ tools|length }}{{ messages|map(attribute='role')|join(', ') }}",
                 id="filters"),
    pytest.param("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                 "{% endfor %}{{ ns.n }}{{ '%03d' % ns.n }}", id="namespace"),
    pytest.param("{% macro f(x) %}[{{ x|upper }}]{% endmacro %}{{ f('a') }}"
                 "{{ 'a b'.split()|length }}{{ 'x'|center(5) }}{{ 'a\\nb'|indent(2) }}"
                 "{{ 'abc'.replace('b', 'X') }}", id="macros-and-methods"),
    pytest.param("{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}"
                 "{% endfor %}", id="loopcontrols"),
])
def test_ordinary_templates_render_as_jinja_does(source: str) -> None:
    want = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                              extensions=["jinja2.ext.loopcontrols"]
                              ).from_string(source).render(**VARIABLES)
    assert render_client_template(source, VARIABLES, LIMITS) == want


def test_tojson_prints_as_transformers_does() -> None:
    """Keys in their order, no HTML escaping (`transformers`' override of Jinja's filter)."""
    out = render_client_template("{{ tools|tojson }}{{ '<a>'|tojson }}", VARIABLES, LIMITS)
    assert out == json.dumps(VARIABLES["tools"]) + '"<a>"'


@pytest.mark.parametrize("source", [
    pytest.param("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                 "{% endfor %}", id="nested-ranges"),
    pytest.param("{% set l = [1] * 1000 %}{% for a in l %}{% for b in l %}{% endfor %}"
                 "{% endfor %}", id="nested-lists"),
    pytest.param("{% for x in 'a' * 1000 %}{% for y in 'a' * 1000 %}{% endfor %}{% endfor %}",
                 id="nested-strings"),
    pytest.param("{{ 'a' * 10**9 }}", id="string-times"),
    pytest.param("{{ [0] * 10**9 }}", id="list-times"),
    pytest.param("{{ 7 ** 100000 }}", id="power"),
    pytest.param("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                 "{% set ns.s = ns.s ~ ns.s %}{% endfor %}", id="doubling-concat"),
    pytest.param("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                 "{% set ns.s = ns.s + ns.s %}{% endfor %}", id="doubling-plus"),
    pytest.param("{% macro d(s, n) %}{{ d(s ~ s, n - 1) if n else s }}{% endmacro %}"
                 "{{ d('ab', 40) }}", id="doubling-macro"),
    pytest.param("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", id="recursion"),
    pytest.param("{{ 'x'|center(10**9) }}", id="center-filter"),
    pytest.param("{{ ('a\\n' * 1000)|indent(10**6) }}", id="indent-filter"),
    pytest.param("{{ ('a' * 1000).replace('', 'b' * 10000) }}", id="replace-method"),
    pytest.param("{{ ('a' * 1000)|replace('', 'b' * 10000) }}", id="replace-filter"),
    pytest.param("{{ ('a' * 10000)|join('b' * 1000) }}", id="join-filter"),
    pytest.param("{{ '%999999999d' % 1 }}", id="percent-width"),
    pytest.param("{{ '%*d'|format(10**9, 1) }}", id="format-star"),
    pytest.param("{{ messages|tojson(indent=10**9) }}", id="tojson-indent"),
    pytest.param("{{ [1, 2]|slice(10**9)|list }}", id="slice-filter"),
    pytest.param("{% for i in range(10) %}{{ 'x' * 200000 }}{% endfor %}", id="output-size"),
])
def test_runaway_templates_stop_at_their_budget(source: str) -> None:
    """Stopped within the time budget: CPU time of this process (the render runs in it),
    which other processes' load does not stretch; the budget is wall time, so a loaded
    machine stops a render with less CPU time spent, never more."""
    t0 = time.process_time()
    with pytest.raises(TemplateBudgetError) as info:
        render_client_template(source, VARIABLES, LIMITS)
    assert time.process_time() - t0 < LIMITS.time_s + 0.5
    assert info.value.status == 400 and info.value.code == "chat_template_budget_exceeded"


def test_a_slow_template_stops_at_its_time_limit() -> None:
    """The loop would run for minutes; its 400 names the time limit, spent in CPU time of
    this process (see above) at most a little over the limit."""
    limits = TemplateLimits(time_s=0.3, max_iterations=10**12)
    t0 = time.process_time()
    with pytest.raises(TemplateBudgetError, match=r"0\.3 s"):
        render_client_template("{% for i in range(10**9) %}{% endfor %}", VARIABLES, limits)
    assert time.process_time() - t0 < 1.0


@pytest.mark.parametrize("source", [
    pytest.param("{{ 1/0 }}", id="zero-division"),
    pytest.param("{% include 'x' %}", id="include"),
    pytest.param("{{ 5 }", id="syntax"),
    pytest.param("{{ ''.__class__.__mro__[1].__subclasses__() }}", id="escape"),
    pytest.param("{{ 'a'.center(10) }}", id="amplifying-method"),
    pytest.param("{{ raise_exception('no tools') }}", id="raise-exception"),
    pytest.param(5, id="not-a-string"),
    pytest.param("x" * (LIMITS.max_source_chars + 1), id="too-long"),
])
def test_failing_templates_are_400(source: object) -> None:
    with pytest.raises(BadRequestError) as info:
        render_client_template(source, VARIABLES, LIMITS)
    assert info.value.status == 400 and info.value.param == "chat_template_kwargs"
