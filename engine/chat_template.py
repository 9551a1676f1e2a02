"""Chat templates rendered in jinja2's sandbox, within a budget.

Chat templates come from downloaded repos, so they are untrusted code. They render in an
ImmutableSandboxedEnvironment that offers what transformers offers templates (the same globals,
filters, extensions and whitespace settings), so a template renders here as `apply_chat_template`
renders it. Each render also spends a budget of steps, characters and seconds, so a hostile template
stops with one line instead of hanging or filling memory (see "the render budget" below).
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import time
import types
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, Sized, ValuesView
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from markupsafe import EscapeFormatter, Markup

# Everything a template can raise while rendering: its own errors and Python errors from its expressions.
TEMPLATE_FAILURES = (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError)


class TemplateFailure(Exception):
    """A template that could not render; the message says why in one line."""


def render(source: str, variables: dict[str, Any]) -> str:
    """The template rendered with `variables`, or TemplateFailure with the reason in one line."""
    try:
        return _render_template(source, variables)
    except TEMPLATE_FAILURES as error:
        problem = " ".join(str(error).split()).rstrip(".") or type(error).__name__
    except RecursionError:
        problem = "the template calls itself too deeply (a macro or recursive loop with no end)"
    except MemoryError:
        problem = "the template ran out of memory"
    raise TemplateFailure(problem)




def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | str | None = None, separators: Any = None,
    sort_keys: bool = False
) -> str:
    # Unlike jinja's own tojson, this does not HTML-escape, and it takes json.dumps' options.
    budget = _budget()
    indent_width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    separator_width = sum(len(s) for s in separators if isinstance(s, str)) if isinstance(separators, (list, tuple)) \
        else 0
    budget.reserve(_text_size(value, budget, indent_width, separator_width), "tojson")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    _budget().reserve(STRFTIME_GROWTH * len(str(format)), "strftime_now")
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` for templates: builds dicts, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names so a template cannot reach Python internals through it."""

    def __init__(*args: Any, **kwargs: Any):
        # `self` comes out of args, as in jinja's Namespace, so `namespace(self=...)` stays a plain attribute.
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _refuse_private_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _refuse_private_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _refuse_private_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


# ---- the render budget: bounded time and memory for an untrusted template ----
#
# jinja's sandbox keeps a template away from Python internals and caps range() at MAX_RANGE, but a
# template may still ask for `'a' * 10**10`, loop 100000 x 100000 times, double a string forty times
# or recurse without end. Each render gets a budget, spent at hooks the template's work passes through:
#   steps  each loop iteration, call, filter, test, operator, `~` and element measured costs one;
#   size   each string, list or number built costs its length (a list item ITEM_COST), reserved *before*
#          the operations whose output can outgrow their inputs (`*`, `**`, `%`, widths, joins, repr);
#   time   a deadline, checked at every step: the backstop for work between steps (a scan of a long
#          string, a sort), each of which is bounded by the size budget.
# A real chat template spends a few steps per message and a few times the conversation's length.

TEMPLATE_STEPS = 250_000  # a real template spends 5-30 per message; 10 us each at worst (a macro call)
TEMPLATE_SIZE = 32 * 2**20  # characters and list items (ITEM_COST each) built in one render, in all
TEMPLATE_SECONDS = 10.0
MACRO_STEPS = 5  # a macro call takes as long as five other steps
TEMPLATE_NUMBER_BITS = 2**16  # integers a template may compute; Python prints only 4300 digits anyway
ITEM_COST = 8  # a list item costs a pointer and more; counting it as 8 characters bounds lists' memory too
ESCAPED_CHAR = 12  # the longest a character gets in repr() or json.dumps(ensure_ascii=True): "\ud83d\ude00"
STRFTIME_GROWTH = 16  # "%c" is 2 characters of format and 24 of date
UNICODE_ESCAPE_GROWTH = 10  # str.encode("unicode_escape") writes up to "\U0001f600" per character
PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?([a-zA-Z%])")


class TemplateBudgetError(SecurityError):
    """A template that would run too long or build too much; rendering stops at the first overrun."""


class _Budget:
    def __init__(self) -> None:
        self.steps = TEMPLATE_STEPS
        self.size = TEMPLATE_SIZE
        self.deadline = time.monotonic() + TEMPLATE_SECONDS

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise TemplateBudgetError(f"the template runs more than {TEMPLATE_STEPS:,} steps (loop iterations, calls, "
                                      "operators); a chat template needs a few per message")
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"the template runs longer than {TEMPLATE_SECONDS:g} s")

    def reserve(self, size: int, what: str) -> None:
        if size > self.size:
            raise TemplateBudgetError(f"{what} would take what the template builds past {TEMPLATE_SIZE:,} characters")
        self.size -= size


_BUDGET: ContextVar[_Budget | None] = ContextVar("duet_template_budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:
        # Outside a render (jinja folding constants while compiling): refusing leaves the work to the render.
        raise TemplateBudgetError("template code ran outside a render")
    return budget


def _built_size(value: Any) -> int:
    """What building value cost: characters, bytes, ITEM_COST per item, or a number's bytes."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return ITEM_COST * len(value)
    if isinstance(value, int):
        return value.bit_length() // 8
    return 0


def _text_size(value: Any, budget: _Budget, indent: int = 0, separator: int = 2) -> int:
    """An upper bound on the length of str(value), pprint or json.dumps of it; stops counting past the budget.

    A list holding one long string 100000 times is small to build and huge to print, so printing is
    measured element by element (one step each) before it happens.
    """
    if isinstance(value, str):
        return len(value)
    total, pending = 0, [(value, 0)]
    while pending and total <= budget.size:
        budget.step()
        item, depth = pending.pop()
        total += 4 + separator + indent * depth  # brackets or quotes, separator, newline and indent
        if isinstance(item, jinja2.utils.Namespace):  # its repr shows its attributes
            item = dict(item._Namespace__attrs)  # type: ignore[attr-defined]
        if isinstance(item, str):
            total += ESCAPED_CHAR * len(item)
        elif isinstance(item, (bytes, bytearray)):
            total += 4 * len(item)
        elif isinstance(item, (dict, ItemsView)):
            pairs = item.items() if isinstance(item, dict) else item
            pending.extend((part, depth + 1) for pair in pairs for part in pair)
        elif isinstance(item, (list, tuple, set, frozenset, KeysView, ValuesView)):
            pending.extend((part, depth + 1) for part in item)
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 1
        else:
            total += 64  # numbers, None, and the short reprs of functions, cyclers, loops and ranges
    return total


def _collect(budget: _Budget, iterable: Iterable[Any], what: str) -> list[Any]:
    """A lazy sequence as a list, built item by item within the budget."""
    items = []
    for item in iterable:
        budget.step()
        budget.reserve(ITEM_COST, what)
        items.append(item)
    return items


def _percent_format_size(budget: _Budget, template: str, values: Any) -> int:
    """An upper bound on len(template % values): widths and precisions, then the values as text."""
    if isinstance(values, dict):
        values = tuple(values.values())
    elif not isinstance(values, tuple):
        values = (values,)
    size, starred, repr_growth = len(template), False, 1
    for width, precision, conversion in PERCENT_SPEC.findall(template):
        starred = starred or "*" in (width, precision)
        size += sum(int(number) for number in (width, precision) if number.isdigit())
        if conversion in "ra":
            repr_growth = ESCAPED_CHAR
    if starred:
        size += sum(abs(v) for v in values if isinstance(v, int))
    return size + repr_growth * sum(_text_size(v, budget) for v in values)


def _number_size(bits: int, operator: str) -> int:
    if bits > TEMPLATE_NUMBER_BITS:
        raise TemplateBudgetError(
            f"operator {operator!r} would make a number of more than {TEMPLATE_NUMBER_BITS:,} bits")
    return bits // 8


def _binop_size(budget: _Budget, operator: str, left: Any, right: Any) -> int:
    """An upper bound on the size of `left operator right`, worked out without computing it."""
    sequences = (str, bytes, list, tuple)
    if operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            return _number_size(left.bit_length() + right.bit_length(), operator)
        if isinstance(left, sequences) and isinstance(right, int):
            return _built_size(left) * max(right, 0)
        if isinstance(right, sequences) and isinstance(left, int):
            return _built_size(right) * max(left, 0)
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            return _number_size(left.bit_length() * right, operator)
    elif operator == "+":
        return _built_size(left) + _built_size(right)
    elif operator == "%" and isinstance(left, str):
        return _percent_format_size(budget, left, right)
    return 0  # -, /, //, and % of numbers: no bigger than their operands


def _method_size(budget: _Budget, owner: Any, name: str, args: tuple, kwargs: dict) -> int:
    """An upper bound on what str/bytes/int methods that can outgrow their input build."""
    first = args[0] if args else None
    if isinstance(owner, int) and name == "to_bytes":
        length = kwargs.get("length", 1) if first is None else first
        return length if isinstance(length, int) else 0
    if not isinstance(owner, (str, bytes, bytearray)):
        return 0
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(first, int):
        return max(first, len(owner))
    if name == "expandtabs":
        tabsize = kwargs.get("tabsize", 8) if first is None else first
        tabsize = tabsize if isinstance(tabsize, int) else 0
        return len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * max(tabsize, 0)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], type(owner)) and isinstance(args[1], type(owner)):
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        hits = owner.count(args[0])
        return len(owner) + (min(hits, count) if isinstance(count, int) and count >= 0 else hits) * len(args[1])
    if name in ("split", "rsplit"):
        separator = kwargs.get("sep") if first is None else first
        pieces = owner.count(separator) + 1 if separator else len(owner) // 2 + 1
        return len(owner) + ITEM_COST * pieces
    if name == "splitlines":
        return len(owner) + ITEM_COST * (len(owner) + 1)
    if name == "encode":
        return UNICODE_ESCAPE_GROWTH * len(owner)
    if name == "hex":
        return 3 * len(owner)
    if name == "translate" and isinstance(first, dict):
        longest = max((len(v) for v in first.values() if isinstance(v, (str, bytes))), default=1)
        return len(owner) * max(longest, 1)
    return 0


def _call_size(budget: _Budget, function: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    """What a call may build, reserved before it runs, and its arguments (a join's items collected)."""
    owner, name = getattr(function, "__self__", None), getattr(function, "__name__", "")
    if isinstance(function, types.BuiltinMethodType) and owner is not None:
        if name == "join" and isinstance(owner, (str, bytes)) and len(args) == 1:
            items = _collect(budget, args[0], "join")
            parts = sum(len(item) for item in items if isinstance(item, (str, bytes)))
            return parts + len(owner) * max(len(items) - 1, 0), (items,)
        return _method_size(budget, owner, name, args, kwargs), args
    if function is jinja2.utils.generate_lorem_ipsum:
        bound = inspect.signature(function).bind(*args, **kwargs)
        bound.apply_defaults()
        paragraphs, words = bound.arguments["n"], bound.arguments["max"]
        if isinstance(paragraphs, int) and isinstance(words, int):
            return 20 * max(paragraphs, 0) * max(words, 0), args
    return 0, args


# Filters whose output can outgrow their input: what each may build, from its arguments (by name).
def _join_filter(budget: _Budget, arguments: dict) -> int:
    arguments["value"] = items = _collect(budget, arguments["value"], "join")
    separator = arguments.get("d", "")
    return sum(_text_size(item, budget) for item in items) + len(str(separator)) * max(len(items) - 1, 0)


def _sum_filter(budget: _Budget, arguments: dict) -> int:
    start = arguments.get("start", 0)
    if isinstance(start, (int, float)):
        return 0
    arguments["iterable"] = items = _collect(budget, arguments["iterable"], "sum")
    return len(items) * sum(_built_size(item) for item in items)  # adding lists copies each partial sum


def _text_of(budget: _Budget, value: Any) -> int:
    return len(value) if isinstance(value, str) else _text_size(value, budget)


def _indent_filter(budget: _Budget, arguments: dict) -> int:
    width = arguments.get("width", 4)
    width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    text = arguments["s"]
    lines = text.count("\n") + 1 if isinstance(text, str) else _text_of(budget, text)
    return _text_of(budget, text) + lines * max(width, 0)


def _replace_filter(budget: _Budget, arguments: dict) -> int:
    text, old, new, count = arguments["s"], arguments["old"], arguments["new"], arguments.get("count")
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return _text_of(budget, text) * (1 + _text_of(budget, new))
    hits = text.count(old)
    return len(text) + (min(hits, max(count, 0)) if isinstance(count, int) else hits) * len(new)


FILTER_SIZES: dict[str, Callable[[_Budget, dict], int]] = {
    "center": lambda b, a: max(a.get("width", 80) if isinstance(a.get("width", 80), int) else 0,
                               _text_of(b, a["value"])),
    "indent": _indent_filter,
    "format": lambda b, a: _percent_format_size(b, str(a["value"]), a.get("kwargs") or a.get("args", ())),
    "join": _join_filter,
    "replace": _replace_filter,
    "wordwrap": lambda b, a: _text_of(b, a["s"]) * (1 + len(str(a.get("wrapstring") or "\n"))),
    "batch": lambda b, a: ITEM_COST * a["linecount"] if isinstance(a["linecount"], int) else 0,
    "slice": lambda b, a: ITEM_COST * a["slices"] if isinstance(a["slices"], int) else 0,
    "sum": _sum_filter,
    "pprint": lambda b, a: _text_size(a["value"], b, indent=1),
    "string": lambda b, a: _text_of(b, a["s"]),
    "urlize": lambda b, a: _text_of(b, a["value"]) * (4 + len(str(a.get("target") or ""))
                                                      + len(str(a.get("rel") or ""))),
    "xmlattr": lambda b, a: 6 * _text_size(a["d"], b),
    "escape": lambda b, a: 6 * _text_of(b, a["s"]),
    "e": lambda b, a: 6 * _text_of(b, a["s"]),
    "forceescape": lambda b, a: 6 * _text_of(b, a["value"]),
    "urlencode": lambda b, a: ESCAPED_CHAR * _text_of(b, a["value"]),
    "list": lambda b, a: ITEM_COST * len(a["value"]) if isinstance(a["value"], Sized) else 0,
}


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """The filter, spending the budget: a step, a lazy input collected, its output reserved (before, if it can grow)."""
    sizer = FILTER_SIZES.get(name)
    signature = inspect.signature(function) if sizer else None
    value_at = 1 if jinja2.utils._PassArg.from_obj(function) else 0  # after the environment or context, if passed
    # jinja's sync/async filters take the context their signature (the sync function's) does not name
    unnamed = value_at if signature is not None and value_at and len(signature.parameters) > 0 and \
        next(iter(signature.parameters)) not in ("environment", "env", "eval_ctx", "context") else 0

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        if len(args) > value_at and isinstance(args[value_at], Iterator):
            args = (*args[:value_at], _collect(budget, args[value_at], f"filter {name!r}"), *args[value_at + 1 :])
        if signature is not None:
            bound = signature.bind(*args[unnamed:], **kwargs)
            budget.reserve(sizer(budget, bound.arguments), f"filter {name!r}")
            args, kwargs = (*args[:unnamed], *bound.args), bound.kwargs
        result = function(*args, **kwargs)
        budget.reserve(_built_size(result), f"filter {name!r}")
        return result

    return bounded


def _bounded_test(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _budget().step()
        return function(*args, **kwargs)

    return bounded


def _finalize(value: Any) -> Any:
    """Each `{{ value }}` written out: its text costs its length."""
    budget = _budget()
    budget.reserve(_text_of(budget, value), "output")
    return value


class _BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, reserving each field's width, precision and text before writing it."""

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None:
            budget = _budget()
            budget.reserve(ESCAPED_CHAR * _text_size(value, budget), "str.format")
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        budget = _budget()
        budget.step()
        widths = sum(int(number) for number in re.findall(r"\d+", format_spec))
        budget.reserve(widths + _text_of(budget, value), "str.format")
        return super().format_field(value, format_spec)


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


def _environment_call(name: str, *args: jinja2.nodes.Expr) -> jinja2.nodes.Call:
    return jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute(name), list(args), [], None, None)


def _is_environment_call(node: jinja2.nodes.Node, name: str) -> bool:
    return (isinstance(node, jinja2.nodes.Call) and isinstance(node.node, jinja2.nodes.EnvironmentAttribute)
            and node.node.name == name)


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles templates so loops, `~` and `*args` go through the environment's budget hooks."""

    def visit_For(self, node: jinja2.nodes.For, frame: Frame) -> None:
        # Each iteration costs a step and the text the body writes as it stands (its share of the output).
        text = sum(len(n.data) for n in node.find_all(jinja2.nodes.TemplateData))
        text += sum(len(n.value) for n in node.find_all(jinja2.nodes.Const) if isinstance(n.value, str))
        counted = _environment_call("duet_iterate", node.iter, jinja2.nodes.Const(text)).set_lineno(node.lineno)
        node = jinja2.nodes.For(node.target, counted, node.body, node.else_, node.test, node.recursive,
                                lineno=node.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.duet_concat((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")

    def signature(self, node: Any, frame: Frame, extra_kwargs: Any = None) -> None:
        if node.dyn_args is not None and not _is_environment_call(node.dyn_args, "duet_collect"):
            node.dyn_args = _environment_call("duet_collect", node.dyn_args).set_lineno(node.lineno)
        super().signature(node, frame, extra_kwargs)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, with every loop, call, filter, test and operator spending the render's budget."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.step()
        budget.reserve(_binop_size(budget, operator, left, right), f"operator {operator!r}")
        return self.binop_table[operator](left, right)

    def call(self, context: jinja2.runtime.Context, function: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        for _ in range(MACRO_STEPS if isinstance(function, jinja2.runtime.Macro) else 1):
            budget.step()
        size, args = _call_size(budget, function, args, kwargs)
        budget.reserve(size, "a call")
        result = super().call(context, function, *args, **kwargs)
        budget.reserve(_built_size(result), "a call")
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        # jinja's own wrapper, with the formatter swapped for one that reserves each field first.
        if super().wrap_str_format(value) is None:
            return None
        text: str = value.__self__
        formatter = (_BoundedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup)
                     else _BoundedFormatter(self))
        is_format_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                args, kwargs = (), args[0]
            return type(text)(formatter.vformat(text, args, kwargs))

        return functools.update_wrapper(bounded, value)

    def duet_iterate(self, iterable: Iterable[Any], text: int) -> Iterator[Any]:
        budget = _budget()
        for item in iterable:
            budget.step()
            budget.reserve(text, "a loop")
            yield item

    def duet_concat(self, values: tuple) -> str:
        budget = _budget()
        budget.step()
        budget.reserve(sum(_text_of(budget, value) for value in values), "operator '~'")
        return jinja2.runtime.str_join(values)

    def duet_collect(self, iterable: Iterable[Any]) -> list[Any]:
        return _collect(_budget(), iterable, "*arguments")


def _template_environment() -> ImmutableSandboxedEnvironment:
    environment = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        finalize=_finalize,
    )
    environment.filters["tojson"] = _tojson
    environment.filters = {name: _bounded_filter(name, f) for name, f in environment.filters.items()}
    environment.tests = {name: _bounded_test(f) for name, f in environment.tests.items()}
    environment.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_TemplateNamespace,
    )
    return environment


_ENVIRONMENT = _template_environment()


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    return _ENVIRONMENT.from_string(source)


def _render_template(source: str, variables: dict[str, Any]) -> str:
    """The template rendered within a fresh budget (compiling folds constants, so that spends it too)."""
    token = _BUDGET.set(_Budget())
    try:
        return _compile_template(source).render(**variables)
    finally:
        _BUDGET.reset(token)
