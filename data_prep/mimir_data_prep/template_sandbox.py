"""The jinja2 environment chat templates render in: as transformers builds its own for
``apply_chat_template`` (sandboxed, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, its
``tojson``, ``raise_exception``, ``strftime_now``, ``dict``, ``namespace``), with a sandbox that
skips, for JSON values only, the checks that cannot apply to them (see :mod:`.render`). Imported
on first use: jinja2 is not loaded by importing `mimir prepare`'s modules.
"""

from __future__ import annotations

import json
import types
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_STR_FORMATTERS = frozenset({"format", "format_map"})  # the sandbox always checks these


def raise_exception(message):
    """``raise_exception`` of transformers' chat templates."""
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


class TemplateDict:  # dict() without attribute access to the type
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):  # no underscore-prefixed attributes
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                f"{name!r}. Please rename the attribute."
            )


class TemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with its attribute verdicts remembered for the types a chat template
    reads (JSON values, ``loop``, namespaces): for them a verdict depends only on the type
    and the attribute's name, and finding it (ABC isinstance tests) was half of a render."""

    verdicts: dict = {}
    remembered = frozenset({str, int, float, bool, type(None), dict, list, jinja2.runtime.LoopContext,
                            TemplateNamespace})

    def is_safe_attribute(self, obj, attr, value):
        kind = type(obj)
        if kind not in self.remembered or type(attr) is not str:
            return super().is_safe_attribute(obj, attr, value)
        verdict = self.verdicts.get((kind, attr))
        if verdict is None:
            verdict = self.verdicts[kind, attr] = super().is_safe_attribute(obj, attr, value)
        return verdict

    def json_builtin(self, obj) -> bool:
        """Whether ``obj`` is a built-in method of a remembered type (dict.get, str.strip)."""
        return type(obj) is types.BuiltinMethodType and type(obj.__self__) in self.remembered

    def is_safe_callable(self, obj):
        # a JSON value's built-in method can carry no unsafe marker
        return self.json_builtin(obj) or super().is_safe_callable(obj)

    def getattr(self, obj, attribute):
        """The sandbox's getattr less its str.format check where no value can be a str's
        format: a dict's or a list's attribute (their own methods or not methods at all), a
        ``loop`` attribute that is a bool or an int (``loop.first``, ``loop.index``)."""
        kind = type(obj)
        if kind is jinja2.runtime.LoopContext:
            try:
                value = getattr(obj, attribute)
            except AttributeError:
                return super().getattr(obj, attribute)
            if type(value) is not bool and type(value) is not int:
                return super().getattr(obj, attribute)
        elif kind is dict or kind is list:
            try:
                value = getattr(obj, attribute)
            except AttributeError:
                try:
                    return obj[attribute]
                except (TypeError, LookupError):
                    return self.undefined(obj=obj, name=attribute)
        else:
            return super().getattr(obj, attribute)
        # a remembered verdict read here, without the call (is_safe_attribute remembers it)
        if self.verdicts.get((kind, attribute)) or self.is_safe_attribute(obj, attribute, value):
            return value
        return self.unsafe_undefined(obj, attribute)

    def call(self, context, obj, /, *args, **kwargs):
        """A JSON value's built-in method called directly: safe (is_safe_callable), it takes
        no context and raises no StopIteration, the two things Context.call looks for."""
        # never a str's format/format_map: jinja before 3.1.5 checks those here, not in getattr
        if self.json_builtin(obj) and obj.__name__ not in _STR_FORMATTERS:
            kwargs.pop("_block_vars", None)  # what jinja's compiled calls pass for Context.call
            kwargs.pop("_loop_vars", None)
            return obj(*args, **kwargs)
        return super().call(context, obj, *args, **kwargs)


def template_environment() -> TemplateEnvironment:
    """A new environment with transformers' filters and globals."""
    env = TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env
