"""A model's chat template, rendered exactly as transformers' `apply_chat_template` does for vLLM.

transformers (5.x, what vLLM 0.32 runs) compiles the template in Jinja's
`ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension and a `{% generation %}` tag, its own `tojson`
filter (no HTML escaping), and the globals `raise_exception` and
`strftime_now`; it renders with `messages`, `tools`, `documents`,
`add_generation_prompt` and the tokenizer's named special tokens (`bos_token`,
`eos_token`, ...), which the call's keyword arguments override. With
`continue_final_message` it marks the last message's content, renders, and
cuts the text at the mark. `ChatTemplate` does the same with the same Jinja.

vLLM decides, once per template, whether message content reaches it as a
string or as a list of OpenAI parts (`content_format`), by looking in the
template's syntax tree for a loop over a message's content
(`vllm/renderers/hf.py::_detect_content_format`); `detect_content_format`
is that rule, ported.

Pure: no I/O; the template's text comes from `caravan_llm.router.tokens.model_tokenizer`.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]

# What transformers appends to the continued message to find where to cut.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The template does not compile, or refuses this conversation (`raise_exception`)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (as transformers' tracker)."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 declares it a plain set

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_: str) -> str:
    # transformers reads the local clock, naive, so the router does too.
    return datetime.now().strftime(format_)  # noqa: DTZ005 - as transformers renders it


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template with what vLLM reads from it once."""

    def __init__(self, source: str) -> None:
        env = _environment()
        try:
            tree = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        self.source = source
        # The names the template reads that nobody assigns (vLLM passes a request's
        # extra keyword only when the template reads it).
        self.variables: frozenset[str] = frozenset(jinja2.meta.find_undeclared_variables(tree))
        self.content_format: ContentFormat = detect_content_format(tree)
        # vLLM turns `developer` messages into `system` ones for templates that never name the role.
        self.knows_developer_role = '"developer"' in source or "'developer'" in source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        variables: Mapping[str, Any],
    ) -> str:
        """The prompt text as transformers renders it; ChatTemplateError if the template refuses."""
        chat: list[Any] = [dict(message) for message in messages]
        final_text: str | None = None
        if continue_final_message:
            final_text, chat[-1] = _mark_final(chat[-1])
        try:
            rendered = self._template.render(
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}") from None
        if final_text is None:
            return rendered
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or tag not in rendered:
            raise ChatTemplateError("the chat template drops the message to continue")
        at = rendered.rindex(tag)
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        return rendered[:at].rstrip()


def _mark_final(message: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return content, {**message, "content": content + _CONTINUE_TAG}
    if isinstance(content, list):
        parts = [dict(part) if isinstance(part, Mapping) else part for part in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                final = part["text"]
                part["text"] = f"{final}{_CONTINUE_TAG}"
                return str(final), {**message, "content": parts}
    raise ChatTemplateError("the final message has no text to continue")


# --- vLLM's content-format detection (vllm/renderers/hf.py, Apache-2.0), ported --------


def detect_content_format(tree: jinja2.nodes.Template) -> ContentFormat:
    """`openai` when the template loops over a message's content, else `string` (vLLM's rule)."""
    try:
        next(_content_loops(tree))
    except StopIteration:
        return "string"
    return "openai"


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var(node.node, name)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _names_bound_to(root: jinja2.nodes.Node, name: str) -> Iterator[str]:
    yield name
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current) and isinstance(
                assign.target, jinja2.nodes.Name
            ):
                yield assign.target.name
                if assign.target.name != current:
                    pending.append(assign.target.name)


def _message_names(root: jinja2.nodes.Node) -> Iterator[str]:
    messages = list(_names_bound_to(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        for name in messages:
            if _is_var_or_elems(loop.iter, name) and isinstance(loop.target, jinja2.nodes.Name):
                yield loop.target.name
                break


def _content_loops(root: jinja2.nodes.Node) -> Iterator[str]:
    message_names = list(_message_names(root))
    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for index, arg in enumerate(call.args):
                if index < len(macro.args) and any(
                    _is_var_or_elems(arg, name, "content") for name in message_names
                ):
                    content_params.add(macro.args[index].name)
            for keyword in call.kwargs:
                if keyword.key in param_names and any(
                    _is_var_or_elems(keyword.value, name, "content") for name in message_names
                ):
                    content_params.add(keyword.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        if not isinstance(loop.target, jinja2.nodes.Name):
            continue
        if any(_is_var_or_elems(loop.iter, name, "content") for name in message_names):
            yield loop.target.name
            continue
        params = params_by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name) and (
            (params is not None and loop.iter.name in params)
            or (id(loop) not in loops_in_macros and loop.iter.name == "content")
        ):
            yield loop.target.name
