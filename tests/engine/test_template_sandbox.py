"""The chat-template sandbox against hostile templates: escapes, and work or memory without bound.

Chat templates come from downloaded repos (DESIGN.md, "Bad input, faults, secrets"). Each attack here
must end in one DuetError line that names the template, never a traceback and never leaked data;
each exhaustion attack must stop within TIME_LIMIT seconds and MEMORY_HEADROOM bytes, and real
templates must render exactly as jinja's stock sandbox renders them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as TokenizersBackend
from tokenizers import models

import duet.engine.chat_template as chat_template
from duet.engine.errors import DuetError
from duet.engine.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
SOURCE = Path("/models/hostile/chat_template.jinja")  # only named in messages, never read
SECRET = "duet-sandbox-secret-7f3a"
MESSAGES = [{"role": "user", "content": "hi"}]
# Each exhaustion case is stopped well within this; unbounded, each runs for minutes or fails to allocate.
TIME_LIMIT = 5.0
# Memory the exhaustion subprocess may map beyond what it holds after import: the budget allows 32 M
# characters (at most 128 MiB as UCS-4) plus lists; anything unbounded asks for gigabytes and fails.
MEMORY_HEADROOM = 1 << 30


def tokenizer_with(template: str) -> Tokenizer:
    return Tokenizer(TokenizersBackend(models.BPE()), {"eos_token": "<|im_end|>"}, frozenset(), template, SOURCE)


def render(template: str, messages: list[dict] = MESSAGES, **options) -> str:
    return tokenizer_with(template).render_chat(messages, **options)


def assert_one_clear_line(error: DuetError) -> None:
    message = str(error)
    assert message.startswith(f"chat template in {SOURCE}: ") and message.endswith("--raw to send the prompt without a template")
    assert "\n" not in message and "Traceback" not in message


# ---- escapes: Python internals, the host's files and environment ----

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.environ }}",
    "{{ joiner.__init__.__globals__['os'].environ }}",
    "{{ self._TemplateReference__context.environment }}",
    "{{ self._TemplateReference__context }}",
    '{{ "{0.__class__.__mro__}".format(messages) }}',
    '{{ "{0.__init__.__globals__}".format(cycler) }}',
    '{{ "{m.__class__.__base__.__subclasses__}".format_map({"m": messages}) }}',
    '{{ "%s"|format(cycler.__init__.__globals__) }}',
    '{{ "%(x)s" % {"x": lipsum.__globals__} }}',
    "{{ namespace.__init__ }}",
    "{{ namespace.__init__.__globals__['os'].environ }}",
    "{{ lipsum.__globals__ }}",
    "{{ lipsum.__globals__['os'].environ }}",
    "{{ range.__class__ }}",
    "{{ range.__class__.__subclasses__() }}",
    "{{ __builtins__ }}",
    "{{ __builtins__.open('/etc/passwd').read() }}",
    "{{ raise_exception.__globals__['os'].environ }}",
    "{{ strftime_now.__globals__['os'].environ }}",
    "{{ dict.__call__.__globals__ }}",
    "{{ (messages|first).__class__.__init__.__globals__ }}",
    "{{ messages.pop() }}{{ messages.append(1) }}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "{{ messages|attr('__class__')|attr('__mro__') }}",
    "{{ (messages|map(attribute='__class__')|list) }}",
    "{{ ''.format.__self__.__class__ }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_escapes_reach_nothing(template: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The sandbox either refuses (one DuetError line) or renders the unsafe attribute as undefined;
    # either way no secret from the environment and no Python internals come out.
    monkeypatch.setenv("DUET_SANDBOX_TEST_SECRET", SECRET)
    try:
        text = render(template)
    except DuetError as error:
        assert_one_clear_line(error)
        text = str(error)
    for leak in (SECRET, "<module", "<class", "<function", "<built-in", "<bound", "root:"):
        assert leak not in text, f"{template} leaked {leak!r}: {text[:200]}"


@pytest.mark.parametrize("tag", ["include", "import", "extends", "from"])
def test_templates_cannot_read_files(tag: str, tmp_path: Path) -> None:
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(SECRET, encoding="utf-8")
    statement = {"import": "import '{}' as s", "from": "from '{}' import x"}.get(tag, tag + " '{}'")
    with pytest.raises(DuetError) as raised:
        render("{% " + statement.format(secret_file) + " %}")
    assert_one_clear_line(raised.value)
    assert SECRET not in str(raised.value)
    assert "no loader" in str(raised.value)


def test_raise_exception_is_a_clear_error() -> None:
    # As Qwen3's template does when the conversation has no user turn.
    template = "{%- if messages|selectattr('role', 'eq', 'user')|list|length == 0 %}" \
               "{{- raise_exception('No user query found in messages.') }}{%- endif %}ok"
    assert render(template) == "ok"
    with pytest.raises(DuetError, match=r"No user query found in messages; use --raw") as raised:
        render(template, messages=[{"role": "system", "content": "be brief"}])
    assert_one_clear_line(raised.value)


# ---- exhaustion: every case runs in one subprocess, with its address space limited ----

EXHAUSTION = {
    "string repeat": ("{{ 'a' * 10**10 }}", "operator '\\*'"),
    "format repeat": ("{{ '%s' * 10**9 }}", "operator '\\*'"),
    "list repeat": ("{{ [1] * 10**9 }}", "operator '\\*'"),
    "huge range": ("{% for i in range(10**9) %}x{% endfor %}", "MAX_RANGE"),
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    "nested loops over a string": ("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{{ b }}{% endfor %}{% endfor %}", "steps|past"),
    "indent width": ("{{ 'x'|indent(10**9) }}", "filter 'indent'"),
    "indent width folded at compile time": ("{{ 'x'|indent(1000000000) }}", "filter 'indent'"),
    "center width": ("{{ 'x'|center(1000000000) }}", "filter 'center'"),
    "str.center": ("{{ 'x'.center(10**9) }}", "a call"),
    "str.replace growth": ("{{ ('a' * 100000).replace('a', 'b' * 100000) }}", "a call"),
    "join of one string many times": ("{% set s = 'a' * 1000000 %}{{ ([s] * 1000)|join }}", "filter 'join'"),
    "printing one string many times": ("{% set s = 'a' * 1000000 %}{{ [s] * 1000 }}", "output"),
    "tojson of one string many times": ("{% set s = 'a' * 1000000 %}{{ ([s] * 1000)|tojson }}", "tojson"),
    "~ doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "operator '~'"),
    "+ doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "operator '\\+'"),
    "list doubling": ("{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", "operator '\\+'"),
    "%-format width": ('{{ "%1000000000d" % 1 }}', "operator '%'"),
    "format filter width": ('{{ "%1000000000d"|format(1) }}', "filter 'format'"),
    "str.format width": ('{{ "{0:>1000000000}".format(1) }}', "str.format"),
    "str.format precision": ('{{ "{:.1000000000f}".format(1.0) }}', "str.format"),
    "power": ("{{ 10 ** (10 ** 10) }}", "bits"),
    "int.to_bytes": ("{{ (1).to_bytes(10**9, 'big') }}", "a call"),
    "lipsum": ("{{ lipsum(10**6) }}", "a call"),
    "deep macro recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "too deeply"),
    "wide macro recursion": ("{% macro f(n) %}{% if n < 40 %}{{ f(n+1) }}{{ f(n+1) }}{% endif %}{% endmacro %}{{ f(0) }}", "steps"),
    "recursive loop": ("{% for x in [1, 2] recursive %}{{ loop([1, 2]) }}{% endfor %}", "too deeply"),
    "literal text in nested loops": ("{% for i in range(100000) %}{% for j in range(100) %}" + "x" * 10000 + "{% endfor %}{% endfor %}", "a loop"),
    "exploding a string into *args": ("{{ cycler(*('x' * 10000000)) }}", "steps|past"),
}

HARNESS = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    from tokenizers import Tokenizer as TokenizersBackend, models
    from duet.engine.errors import DuetError
    from duet.engine.tokenizer import Tokenizer
    cases, headroom = json.loads(sys.stdin.read())
    size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, size + headroom))
    for name, template in cases.items():
        tokenizer = Tokenizer(TokenizersBackend(models.BPE()), {}, frozenset(), template, Path("SOURCE_PATH"))
        start = time.perf_counter()
        try:
            outcome = "rendered " + str(len(tokenizer.render_chat([{"role": "user", "content": "hi"}])))
        except DuetError as error:
            outcome = str(error)
        except BaseException as error:
            outcome = "NOT A DuetError: " + repr(error)[:300]
        print(json.dumps([name, outcome, time.perf_counter() - start]), flush=True)
""")


@pytest.fixture(scope="module")
def exhaustion_outcomes() -> dict[str, tuple[str, float]]:
    cases = {name: template for name, (template, _) in EXHAUSTION.items()}
    done = subprocess.run(
        [sys.executable, "-c", HARNESS.replace("SOURCE_PATH", str(SOURCE))], input=json.dumps([cases, MEMORY_HEADROOM]),
        capture_output=True, text=True, cwd=REPO, timeout=len(cases) * TIME_LIMIT,
    )
    outcomes = {}
    for line in done.stdout.splitlines():
        name, outcome, seconds = json.loads(line)
        outcomes[name] = (outcome, seconds)
    assert done.returncode == 0, done.stderr[-2000:]
    return outcomes


@pytest.mark.parametrize("name", EXHAUSTION)
def test_exhaustion_stops_with_one_line_in_bounded_time(name: str, exhaustion_outcomes) -> None:
    outcome, seconds = exhaustion_outcomes[name]
    assert outcome.startswith(f"chat template in {SOURCE}: "), outcome
    assert "\n" not in outcome and outcome.endswith("use --raw to send the prompt without a template")
    assert re.search(EXHAUSTION[name][1], outcome), outcome
    assert seconds < TIME_LIMIT, f"{name} took {seconds:.1f} s"


def test_work_between_steps_meets_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Scanning a long string costs one step however long it is; the deadline stops a loop of scans.
    monkeypatch.setattr(chat_template, "TEMPLATE_SECONDS", 0.2)
    template = "{% set s = 'a' * 30000000 %}{% for i in range(100000) %}{% if 'b' in s %}{% endif %}{% endfor %}"
    with pytest.raises(DuetError, match=r"runs longer than 0\.2 s") as raised:
        render(template)
    assert_one_clear_line(raised.value)


# ---- real templates render exactly as jinja's stock sandbox renders them ----

# In the manner of Qwen3's template: tools, reasoning kept only after the last user query, tool
# responses grouped, a reversed scan with namespace state, raise_exception on an unknown role.
QWEN_STYLE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {{- '\\n<tool_call>\\n{"name": "' ~ call.name ~ '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' ~ content ~ '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- elif message.role != "system" %}
        {{- raise_exception('Unexpected message role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Météo — <b>not</b> escaped",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def long_conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "Be brief."}]
    for turn in range(turns):
        messages += [
            {"role": "user", "content": f"Question {turn}: what is 東京 like? 🙂 " * 5},
            {"role": "assistant", "content": f"<think>\nturn {turn}\n</think>\n\nIt is big. " * 3,
             "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "東京"}}}]},
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "tool", "content": '{"rain": false}'},
        ]
    return messages + [{"role": "user", "content": "And now?"}]


def stock_sandbox_render(template: str, messages: list[dict], **variables) -> str:
    """The template as transformers-style jinja renders it, with none of duet's bounds."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = lambda value, **options: json.dumps(value, ensure_ascii=False, **options)
    environment.globals.update(raise_exception=chat_template._raise_exception,
                               namespace=chat_template._TemplateNamespace)
    return environment.from_string(template).render(messages=messages, eos_token="<|im_end|>", documents=None, **variables)


@pytest.mark.parametrize("template_name", ["qwen-style", "models/demo"])
@pytest.mark.parametrize("enable_thinking", [None, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_real_templates_render_as_the_stock_sandbox_does(template_name: str, enable_thinking, tools) -> None:
    template = QWEN_STYLE if template_name == "qwen-style" else (REPO / "models/demo/chat_template.jinja").read_text()
    messages = long_conversation(3) if template_name == "qwen-style" else long_conversation(3)[1:2]
    thinking = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = stock_sandbox_render(template, messages, tools=tools, add_generation_prompt=True, **thinking)
    assert render(template, messages, tools=tools, enable_thinking=enable_thinking) == expected
    assert "<tool_response>" in expected or template_name != "qwen-style"


def test_a_long_conversation_fits_the_budget() -> None:
    # 500 turns (2000 messages, with tool calls) of the Qwen-style template spend under a fifth of the
    # step budget and a few percent of the size budget.
    messages = long_conversation(500)
    rendered = render(QWEN_STYLE, messages, tools=TOOLS)
    assert rendered == stock_sandbox_render(QWEN_STYLE, messages, tools=TOOLS, add_generation_prompt=True)


def test_qwen_style_unknown_role_is_a_clear_error() -> None:
    with pytest.raises(DuetError, match=r"Unexpected message role: narrator; use --raw") as raised:
        render(QWEN_STYLE, [{"role": "narrator", "content": "once"}])
    assert_one_clear_line(raised.value)
