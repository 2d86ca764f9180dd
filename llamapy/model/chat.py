"""Chat templates rendered safely (llama.cpp's `common/chat.cpp` + minja; transformers'
`apply_chat_template`).

A GGUF carries its chat template as Jinja source in `tokenizer.chat_template`. That source comes
from whoever made the file, so it is untrusted code: it is rendered only in jinja2's
`ImmutableSandboxedEnvironment`, configured the way transformers configures it (trim_blocks,
lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, a `tojson` that does not
HTML-escape) so that a template renders here exactly as it does under transformers.

The sandbox already refuses private/internal attributes and mutation of lists and dicts. It does
not bound resources, so this module adds, per render:
- size limits on what `*`, `+`, `**`, `~`, `%`, filters and string methods may build, checked
  *before* the value is built (`'a' * 10**10` fails at once instead of allocating 10 GB);
- a step budget charged on every loop iteration and every call (nested `range` loops and
  exponential macro recursion stop after a bounded amount of work);
- a character budget charged on everything a template outputs, including into `{% set %}` blocks.
Every failure, whatever its cause, surfaces as a one-line `ChatTemplateError`.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import json
import math
import re
import time
import types
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterable, Iterator

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum

from llamapy.types import LlamapyError

__all__ = [
    "CHATML_TEMPLATE",
    "ChatTemplateError",
    "RenderLimits",
    "render_chat",
    "template_or_default",
]


class ChatTemplateError(LlamapyError):
    """A chat template that does not compile, fails at run time, calls `raise_exception`,
    touches something the sandbox forbids, or exceeds a resource limit."""


# llama.cpp falls back to chatml when a model has no template (common/chat.cpp); this is the
# same format written as Jinja so that both paths go through one renderer.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def template_or_default(template: str | None) -> str:
    """The GGUF's `tokenizer.chat_template`, or chatml when the file has none."""
    return template if template else CHATML_TEMPLATE


@dataclass(frozen=True)
class RenderLimits:
    """Resource bounds of one render. Generous for any real chat prompt (10 M characters is
    millions of tokens, far past any context), small enough to fail within seconds."""

    max_len: int = 10_000_000  # longest string/list any single operation may build
    max_steps: int = 1_000_000  # loop iterations + calls
    max_seconds: float = 2.0  # wall clock, for steps that are each expensive (macro calls)
    max_output: int = 50_000_000  # characters output in total, `{% set %}` blocks included
    max_int_bits: int = 100_000  # integers built by `*` and `**`


LIMITS = RenderLimits()


# ---------------------------------------------------------------------------------------------
# per-render budget


class _Budget:
    """Work left in the current render; one per `render_chat` call, found through a ContextVar
    so that concurrent renders in other threads keep their own."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.steps = limits.max_steps
        self.output = limits.max_output
        self.deadline = time.monotonic() + limits.max_seconds

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise SecurityError(f"template exceeded {self.limits.max_steps} steps")
        # Reading the clock every step would cost more than the step; every 1024th suffices.
        if self.steps & 1023 == 0 and time.monotonic() > self.deadline:
            raise SecurityError(f"template ran longer than {self.limits.max_seconds} s")

    def emit(self, n: int) -> None:
        self.output -= n
        if self.output < 0:
            raise SecurityError(f"template output exceeded {self.limits.max_output} characters")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("llamapy_chat_budget", default=None)


def _step() -> None:
    # Outside a render (jinja's compile-time constant folding) there is nothing to charge.
    budget = _BUDGET.get()
    if budget is not None:
        budget.step()


def _check_len(n: int, what: str) -> None:
    if n > LIMITS.max_len:
        raise SecurityError(f"{what} would build {n} items (limit {LIMITS.max_len})")


def _check_int_args(args: Iterable[Any], what: str) -> None:
    # Widths, counts and repeats are the arguments that turn one call into gigabytes
    # (`center(10**10)`, `batch(10**10, 'x')`, `ljust(...)`); none is ever that large in a
    # real template.
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > LIMITS.max_len:
            raise SecurityError(f"{what}: argument {a} is too large (limit {LIMITS.max_len})")


# A printf/str.format width or precision with 8+ digits builds a string of 10 M characters or more.
_HUGE_WIDTH = re.compile(r"\d{8,}")


def _check_format_string(fmt: Any, what: str) -> None:
    if isinstance(fmt, str) and _HUGE_WIDTH.search(fmt):
        raise SecurityError(f"{what}: format width too large")


def _metered(iterable: Any) -> Iterator[Any]:
    """Wraps the iterable of every `{% for %}`: one step per iteration."""
    for item in iterable:
        _step()
        yield item


# ---------------------------------------------------------------------------------------------
# the environment


class _TemplateRaised(TemplateError):
    """`raise_exception(msg)` from the template itself (transformers raises TemplateError)."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces jinja's tojson, which HTML-escapes <, >, & and '; same signature.
    if isinstance(indent, int) and indent > 1000 or isinstance(indent, str) and len(indent) > 1000:
        raise SecurityError("tojson: indent too large")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    # jinja's default global, kept for parity; its size is the product of its arguments.
    if n * max > 100_000:
        raise SecurityError("lipsum: too large")
    return str(generate_lorem_ipsum(n=n, html=html, min=min, max=max))


def _estimate_replace(s: Any, old: Any, new: Any) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        grow = max(len(new) - len(old), 0)
        if grow:
            _check_len(len(s) + s.count(old) * grow, "replace")


def _guard_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """A filter with its arguments checked before it runs and its work charged one step.

    Filters are compiled into direct calls, bypassing the sandbox's `call`, so they are
    wrapped here. `functools.wraps` copies `jinja_pass_arg`, keeping pass_context & co.
    """

    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _step()
        _check_int_args(args, name)
        _check_int_args(kwargs.values(), name)
        plain = [a for a in args if not isinstance(a, (jinja2.runtime.Context,
                                                       jinja2.nodes.EvalContext,
                                                       jinja2.Environment))]
        if name == "replace" and len(plain) >= 3:
            _estimate_replace(plain[0], plain[1], plain[2])
        elif name == "format" and plain:
            _check_format_string(plain[0], name)
        elif name == "indent" and plain:
            width = plain[1] if len(plain) > 1 else kwargs.get("width", 4)
            text = str(plain[0])
            pad = len(width) if isinstance(width, str) else int(width)
            _check_len(len(text) + (text.count("\n") + 1) * pad, name)
        elif name == "join" and plain:
            sep = plain[1] if len(plain) > 1 else kwargs.get("d", "")
            if isinstance(sep, str) and hasattr(plain[0], "__len__"):
                _check_len(len(sep) * len(plain[0]), name)
        return f(*args, **kwargs)

    return guarded


class _BoundedCodeGenerator(CodeGenerator):
    """jinja's code generator with two more hooks the sandbox lacks: `~` goes through a size
    check, and every output expression is charged to the render's character budget."""

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write("environment.charge_output(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        super()._output_child_post(node, frame, finalize)
        self.write(")")


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, plus resource bounds."""

    code_generator_class = _BoundedCodeGenerator
    # Intercepted operators also stop jinja from folding `'a' * 10**10` at compile time.
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["lipsum"] = _lipsum

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        # Route every loop's iterable through `_metered` so each iteration costs a step.
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(
                nodes.ImportedName(f"{__name__}._metered"), [loop.iter], [], None, None,
                lineno=loop.lineno,
            ).set_environment(self)
        return tree

    # -- hooks called by the generated code ---------------------------------------------------

    def bounded_concat(self, parts: tuple[Any, ...]) -> str:
        strs = [str(p) for p in parts]
        _check_len(sum(len(s) for s in strs), "~")
        return "".join(strs)

    def charge_output(self, s: str) -> str:
        budget = _BUDGET.get()
        if budget is not None:
            budget.emit(len(s))
        return s

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _step()
        seq = (str, bytes, list, tuple)
        if operator == "*":
            for a, b in ((left, right), (right, left)):
                if isinstance(a, seq) and isinstance(b, int):
                    _check_len(len(a) * max(b, 0), "*")
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > LIMITS.max_int_bits:
                    raise SecurityError("*: integer too large")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                if right * math.log2(abs(left)) > LIMITS.max_int_bits:
                    raise SecurityError("**: integer too large")
        elif operator == "+":
            if isinstance(left, seq) and isinstance(right, seq):
                _check_len(len(left) + len(right), "+")
        elif operator == "%":
            if isinstance(left, str):
                _check_format_string(left, "%")
                _check_int_args(right if isinstance(right, tuple) else (right,), "%")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _step()
        if isinstance(__obj, types.BuiltinMethodType) and isinstance(
            getattr(__obj, "__self__", None), (str, bytes, list, tuple, dict)
        ):
            # str methods whose size is set by an argument: center/ljust/rjust/zfill widths,
            # replace's growth, expandtabs' tab size, join's separator.
            owner = __obj.__self__
            _check_int_args(args, __obj.__name__)
            _check_int_args(kwargs.values(), __obj.__name__)
            if __obj.__name__ == "replace" and len(args) >= 2:
                _estimate_replace(owner, args[0], args[1])
            elif __obj.__name__ == "expandtabs" and isinstance(owner, str):
                size = args[0] if args else kwargs.get("tabsize", 8)
                if isinstance(size, int):
                    _check_len(len(owner) + owner.count("\t") * size, "expandtabs")
            elif __obj.__name__ == "join" and isinstance(owner, str) and args:
                if hasattr(args[0], "__len__"):
                    _check_len(len(owner) * len(args[0]), "join")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__

        @functools.wraps(wrapper)
        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format_string(fmt, "format")
            _check_int_args(args, "format")
            _check_int_args(kwargs.values(), "format")
            return wrapper(*args, **kwargs)

        return checked

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # The sandbox returns an Undefined that only fails when used, so `{{ x.__class__ }}`
        # quietly prints nothing; an attempt to reach internals is an error here.
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


_ENV = _ChatEnvironment()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    # Templates are a few KB and one per model; caching the compiled form makes a chat turn's
    # render cost only the render.
    try:
        return _ENV.from_string(template)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): "
                                f"{_one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - any failure of untrusted code is the template's
        raise ChatTemplateError(f"chat template does not compile: {_one_line(e)}") from None


def render_chat(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` with the chat template as transformers' apply_chat_template would.

    `extra` are further template variables (tools, documents, enable_thinking, ...); transformers
    passes `tools` and `documents` as None when absent, and so does this.
    """
    compiled = _compile(template)
    # The caller's messages are copied so that no hole in the sandbox could ever change them.
    variables: dict[str, Any] = {"tools": None, "documents": None}
    variables.update(copy.deepcopy(extra))
    variables.update(messages=copy.deepcopy(messages), add_generation_prompt=add_generation_prompt,
                     bos_token=bos_token, eos_token=eos_token)
    token = _BUDGET.set(_Budget(LIMITS))
    try:
        return "".join(compiled.generate(**variables))
    except ChatTemplateError:
        raise
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template raised an exception: {_one_line(e)}") from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat template blocked by the sandbox: {_one_line(e)}") from None
    except RecursionError:
        raise ChatTemplateError("chat template recursed too deeply") from None
    except Exception as e:  # noqa: BLE001 - untrusted code may raise anything
        raise ChatTemplateError(
            f"chat template failed: {type(e).__name__}: {_one_line(e)}"
        ) from None
    finally:
        _BUDGET.reset(token)
