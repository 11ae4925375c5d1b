"""The render stage of `mimir prepare`: a screened conversation through the tokenizer's chat
template into (prefix text, response text) (:class:`mimir_megatron.chat.ChatRenderer` defines
them), checked against the response minimum and fitted to the context (``--too-long``).

``ChatRenderer.render`` renders each conversation twice: the whole of it, and all but the final
assistant turn with the generation prompt (the prefix). :class:`SingleRender` renders it once,
where the template's own structure proves that gives the same two texts; it is decided once per
template (:func:`single_render_plan`), and a template it cannot prove is rendered twice.

The proof. A template whose top level is (anything that does not read ``messages`` or
``add_generation_prompt``) + ``{% for m in messages %}BODY{% endfor %}`` + (constant text, some
of it under ``{% if add_generation_prompt %}``), where BODY looks only backwards (``loop.first``,
``loop.index``, ``loop.previtem``; never ``loop.last``/``length``/``revindex``/``nextitem``),
and nothing else reads ``messages`` but ``messages[k]`` at constant k, renders the whole
conversation as H + TURN(last) + TAIL(False) and the prefix as H + TAIL(True): the two runs make
the same observations (hence the same output H) until the loop fetches the final message, and
what follows the loop is constant. So one render of the whole, with a marker written where the
final turn starts, gives both: prefix = H + TAIL(True), whole = H + the rest. The marker holds a
random nonce; a render that does not hold it exactly once goes the two-render way.

The template is compiled once with jinja2 (public API), in an environment built as
transformers builds its own (sandboxed, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
its ``tojson``, ``raise_exception``, ``strftime_now``, ``dict``, ``namespace``); its sandbox
skips, for JSON values (and ``loop``'s bool and int attributes) only, the checks that cannot
apply to them (a remembered attribute verdict; no ``str.format`` wrapping of a dict's or list's
attribute or of ``loop.first``; a built-in method called without ``Context.call``), and refuses
what jinja's own sandbox refuses (tested). The messages
are passed as ``apply_chat_template`` passes them (keys whose value is None dropped, the reasoning
field aliases filled). Each process also checks, once, that the single render equals the two
renders on probe conversations; anything that cannot be matched exactly (non-JSON values, tools
that are not dicts, too few messages, a template selected by name) goes the two-render way.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from mimir_megatron.chat import ChatRenderer, ChatTemplateError

from .records import Conversation, RecordError
from .settings import PrepareSettings

log = logging.getLogger(__name__)

# loop attributes that look only backwards: the same in the prefix's run and the whole's
_BACKWARD_LOOP_ATTRS = frozenset({"first", "index", "index0", "previtem", "changed", "cycle",
                                  "depth", "depth0"})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as transformers aliases them
_PLAIN_SCALARS = (str, int, float, bool)
_LAST_VAR = "mimir_single_render_last_index"  # the variable the marker's test reads


def render_texts(conv: Conversation, renderer: ChatRenderer | SingleRender) -> tuple[str, str]:
    """(prefix text, response text); a ``template_error`` RecordError when the template fails."""
    try:
        return renderer.render(conv.messages, conv.tools)
    except ChatTemplateError as exc:
        raise RecordError("template_error", str(exc)) from None


# --- one render per conversation ----------------------------------------------------------------


@dataclass(frozen=True)
class SingleRenderPlan:
    """A template proven renderable once: the marked template, the text the generation prompt
    adds after the loop, and the highest constant ``messages[k]`` index it reads."""

    template: Any  # jinja2.Template, compiled with the marker
    marker: str
    generation_tail: str
    max_index: int


def template_environment():
    """A jinja2 environment that renders as transformers' ``apply_chat_template`` does
    (:mod:`.template_sandbox`; jinja2 is imported on first use)."""
    from .template_sandbox import template_environment as environment

    return environment()


def single_render_plan(source: str, env=None) -> SingleRenderPlan | str:
    """The plan that renders ``source`` once per conversation, or the reason it cannot be proven."""
    import jinja2
    from jinja2 import nodes

    env = env or template_environment()
    try:
        tree = env.parse(source)
    except jinja2.TemplateSyntaxError as exc:  # e.g. transformers' {% generation %} extension
        return f"not parsed without transformers' extensions ({exc.message})"
    body = tree.body
    loops = [i for i, n in enumerate(body) if isinstance(n, nodes.For) and _is_name(n.iter, "messages")]
    if len(loops) != 1:
        return "not one top-level {% for ... in messages %}"
    at = loops[0]
    loop = body[at]
    if loop.recursive or loop.test is not None or loop.else_:
        return "the messages loop is recursive, filtered or has an else"
    problems: list[str] = []
    max_index = [0]
    tail = _constant_tail(body[at + 1 :], problems)
    for n in body[:at]:
        _check(n, None, problems, max_index, main_loop=False)
    _check(loop.target, loop, problems, max_index, main_loop=False)
    for n in loop.body:
        _check(n, loop, problems, max_index, main_loop=True)
    if problems:
        return problems[0]
    marker = f"\ue000mimir-turn-{os.urandom(12).hex()}\ue001"
    test = nodes.Compare(nodes.Getattr(nodes.Name("loop", "load"), "index", "load"),
                         [nodes.Operand("eq", nodes.Name(_LAST_VAR, "load"))])
    mark = nodes.If(test, [nodes.Output([nodes.TemplateData(marker)])], [], [])
    mark.set_lineno(loop.lineno)
    mark.set_environment(env)
    loop.body.insert(0, mark)
    try:
        template = env.from_string(tree)
    except jinja2.TemplateError as exc:  # an unknown filter, say: the two renders report it
        return f"not compiled ({exc})"
    # A plain dict of the globals (nothing changes this environment's): jinja's own is a ChainMap
    # over the environment's, which every render merged key by key in Python (~8 us a conversation).
    template.globals = dict(template.globals)
    return SingleRenderPlan(template, marker, tail, max_index[0])


def _is_name(node, name: str) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.name == name


def _constant_tail(after: list, problems: list[str]) -> str:
    """What the nodes after the loop add when ``add_generation_prompt`` is true, if they are
    constant text, some under ``{% if add_generation_prompt %}`` (else a problem is noted)."""
    from jinja2 import nodes

    def text(block: list) -> str | None:
        out = []
        for n in block:
            if not isinstance(n, nodes.Output):
                return None
            for c in n.nodes:
                if isinstance(c, nodes.TemplateData):
                    out.append(c.data)
                elif isinstance(c, nodes.Const) and isinstance(c.value, str):
                    out.append(c.value)
                else:
                    return None
        return "".join(out)

    tail = []
    for n in after:
        if isinstance(n, nodes.If) and _is_name(n.test, "add_generation_prompt") and not n.elif_:
            part = text(n.body)
            if part is None or text(n.else_) is None:
                problems.append("what follows the messages loop is not constant text")
                return ""
            tail.append(part)
        elif (part := text([n])) is not None:
            tail.append(part)
        else:
            problems.append("what follows the messages loop is not constant text")
            return ""
    return "".join(tail)


def _check(node, loop, problems: list[str], max_index: list[int], *, main_loop: bool, parent=None) -> None:
    """Note what makes the output before the final turn depend on it: ``messages`` read other
    than at a constant index, ``add_generation_prompt`` read, or the main loop looking ahead."""
    from jinja2 import nodes

    if isinstance(node, (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends, nodes.Block)):
        problems.append(f"the template uses {{% {type(node).__name__.lower()} %}}")
        return
    if isinstance(node, nodes.Name):
        if node.name == "add_generation_prompt":
            problems.append("add_generation_prompt is read before or inside the messages loop")
        elif node.name == "messages":
            arg = parent.arg if isinstance(parent, nodes.Getitem) and parent.node is node else None
            if isinstance(arg, nodes.Const) and type(arg.value) is int and arg.value >= 0:
                max_index[0] = max(max_index[0], arg.value)
            else:
                problems.append("messages is read other than by the loop or at a constant index")
        elif node.name == _LAST_VAR:
            problems.append(f"the template reads {_LAST_VAR}")
        elif node.name == "loop" and main_loop:
            if not (isinstance(parent, nodes.Getattr) and parent.node is node
                    and parent.attr in _BACKWARD_LOOP_ATTRS):
                problems.append("the messages loop looks ahead (loop.last, loop.length, ...)")
        return
    if isinstance(node, nodes.For) and main_loop:
        # `loop` in a nested loop's body is that loop's; in its iterable and filter, still ours
        for n in (node.iter, node.test):
            if n is not None:
                _check(n, loop, problems, max_index, main_loop=True, parent=node)
        for n in [node.target, *node.body, *node.else_]:
            _check(n, loop, problems, max_index, main_loop=False, parent=node)
        if node.recursive:
            problems.append("a recursive loop inside the messages loop")
        return
    for child in node.iter_child_nodes():
        _check(child, loop, problems, max_index, main_loop=main_loop, parent=node)


class SingleRender:
    """A :class:`ChatRenderer`'s ``render`` with one template render per conversation where
    :func:`single_render_plan` proves it equal; the renderer's own two renders otherwise."""

    def __init__(self, renderer: ChatRenderer) -> None:
        self.renderer = renderer
        tokenizer = renderer.tokenizer
        source = getattr(tokenizer, "chat_template", None)
        self.special = dict(tokenizer.special_tokens_map)
        plan = single_render_plan(source) if isinstance(source, str) else "the tokenizer has named templates"
        if isinstance(plan, SingleRenderPlan) and (wrong := self._probe(plan)):
            plan = f"its single render differs from the two renders on a probe conversation ({wrong})"
        self.plan = plan if isinstance(plan, SingleRenderPlan) else None
        self.reason = None if self.plan else plan
        if self.reason:
            log.info("the chat template is rendered twice per conversation: %s", self.reason)

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> tuple[str, str]:
        """(prefix text, response text), as ``ChatRenderer.render`` gives them."""
        if self.plan is not None:
            texts = self._render_once(self.plan, messages, tools)
            if texts is not None:
                return texts
        return self.renderer.render(messages, tools)

    def _render_once(self, plan: SingleRenderPlan, messages, tools) -> tuple[str, str] | None:
        """Both texts from one render, or None when this conversation is not provably the same."""
        if len(messages) < 2 + plan.max_index:  # the prefix must hold every messages[k] read
            return None
        if tools is not None and not (all(type(t) is dict for t in tools) and _plain(tools)):
            return None
        chat = []
        for message in messages:
            if type(message) is not dict or not _plain(message):
                return None
            if None in message.values():  # the template never gets to change a message: no copy
                message = {k: v for k, v in message.items() if v is not None}
            for field in _REASONING_FIELDS:
                if (reasoning := message.get(field)) is not None:
                    message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
                    break
            chat.append(message)
        try:
            text = plan.template.render(**self.special, messages=chat, tools=tools, documents=None,
                                        add_generation_prompt=False, **{_LAST_VAR: len(chat)})
        except Exception as exc:  # the whole's render fails first in the two-render way too
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None
        at = text.find(plan.marker)
        if at < 0 or text.find(plan.marker, at + 1) >= 0:
            return None
        # whole = head + rest and prefix = head + tail: the whole starts with the prefix where
        # the rest starts with the tail, and the response is the rest after it
        rest = text[at + len(plan.marker) :]
        if not rest.startswith(plan.generation_tail):
            return None  # the two-render way raises its own error
        prefix = text[:at] + plan.generation_tail
        return prefix, self.renderer._cut_after_end_of_turn(rest[len(plan.generation_tail) :])

    def _probe(self, plan: SingleRenderPlan) -> str | None:
        """The first probe conversation whose single render differs from the two renders."""
        for messages, tools in _PROBES:
            try:
                want: Any = self.renderer.render(messages, tools)
            except ChatTemplateError as exc:
                want = str(exc)
            try:
                got: Any = self._render_once(plan, messages, tools)
            except ChatTemplateError as exc:
                got = str(exc)
            if got is not None and got != want:
                return f"{len(messages)} messages"
        return None


def _plain(value) -> bool:
    """Only JSON types (what transformers passes to a template unchanged)."""
    kind = type(value)
    if kind in _PLAIN_SCALARS or value is None:
        return True
    if kind is dict:  # loops, not all() over a generator: this runs for every message
        for key, item in value.items():
            if type(key) is not str or not (type(item) in _PLAIN_SCALARS or item is None or _plain(item)):
                return False
        return True
    if kind is list:
        for item in value:
            if not (type(item) in _PLAIN_SCALARS or item is None or _plain(item)):
                return False
        return True
    return False


_TOOL = {"type": "function", "function": {
    "name": "weather", "description": "Vejret i byen",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
_CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Århus"}}}
_PROBES: list[tuple[list[dict[str, Any]], list[Any] | None]] = [
    ([{"role": "user", "content": "Hej"}, {"role": "assistant", "content": "Hej med dig 😀"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"}, {"role": "user", "content": ""},
      {"role": "assistant", "content": " trailing space "}], None),
    ([{"role": "system", "content": ""}, {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": None, "tool_calls": [_CALL]},
      {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "c1"},
      {"role": "assistant", "content": "3 °C.", "reasoning_content": "read the tool"}], [_TOOL]),
    ([{"role": "user", "content": "ny\nlinje</think>"},
      {"role": "assistant", "content": "", "tool_calls": [_CALL]}], [_TOOL]),
]


# --- fitting to the context ----------------------------------------------------------------------


def fit_document(prefix: list[int], response: list[int], settings: PrepareSettings) -> tuple[list[int], bool]:
    """(prefix to keep, truncated?) of a tokenized document; RecordError when its response is
    too short or it does not fit the context under the too-long policy."""
    if len(response) < settings.min_response_tokens:
        raise RecordError(
            "response_too_short",
            f"{len(response)} response tokens, need >= {settings.min_response_tokens}",
        )
    return fit_to_context(prefix, response, settings)


def fit_to_context(
    prefix: list[int], response: list[int], settings: PrepareSettings
) -> tuple[list[int], bool]:
    """Apply the too-long policy. Packed input length is len(prefix) + len(response) - 1."""
    if len(prefix) + len(response) - 1 <= settings.seq_len:
        return prefix, False
    keep = settings.seq_len + 1 - len(response)
    if settings.too_long == "truncate-prefix" and keep >= 1:
        # Keep the end of the prefix: it holds the generation prompt the response follows.
        return prefix[-keep:], True
    raise RecordError(
        "too_long",
        f"{len(prefix)} prefix + {len(response)} response tokens exceed seq_len={settings.seq_len}",
    )
