"""A plugin layer's typed params: ``python_param.param_str`` parsed into the dataclass it declares.

A layer sets ``Params`` to a dataclass; ``set_up`` fills ``self.params`` before ``setup``::

    @dataclass
    class Params:
        eps: float = 1e-10
        channels: list[int] = field(default_factory=list)

``param_str`` is then either ``key=value`` pairs separated by spaces or commas
(``"eps=1e-6 scale=false"``; no lists) or a JSON or Python dict (``'{"eps": 1e-6}'``,
``"{'channels': [1, 2]}"``). Fields may be bool, int, float, str, or a list/tuple of those;
missing fields take their defaults, and unknown keys or wrong types are errors.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import re
import typing

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _coerce(key: str, tp, value, text: bool):
    def bad():
        return ValueError(f"param '{key}' must be {getattr(tp, '__name__', tp)}, got {value!r}")

    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        if text or not isinstance(value, (list, tuple)):
            raise ValueError(f"param '{key}' is a list: give param_str as a dict, e.g. "
                             f"\"{{'{key}': [1, 2]}}\"")
        args = [a for a in typing.get_args(tp) if a is not Ellipsis] or [str]
        return origin(_coerce(f"{key}[{i}]", args[0], v, False) for i, v in enumerate(value))
    if tp is bool:
        if text and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        if not text and isinstance(value, bool):
            return value
        raise bad()
    if tp in (int, float):
        if text:
            try:
                return tp(value)
            except ValueError:
                raise bad() from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                tp is int and not isinstance(value, int)):
            raise bad()
        return tp(value)
    if tp is str:
        if text or isinstance(value, str):
            return value
        raise bad()
    raise TypeError(f"Params field '{key}' has type {tp}; fields may be bool, int, float, str or "
                    "a list/tuple of those")


def _pairs(text: str) -> tuple[dict, bool]:
    """The raw key -> value mapping, and whether the values are still text."""
    s = text.strip()
    if not s:
        return {}, False
    if s.startswith("{"):
        try:
            d = json.loads(s)
        except json.JSONDecodeError:
            try:
                d = ast.literal_eval(s)
            except (ValueError, SyntaxError):
                raise ValueError(f"param_str {text!r} is neither a JSON nor a Python dict") from None
        if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
            raise ValueError(f"param_str {text!r} must be a dict with string keys")
        return d, False
    out = {}
    for item in filter(None, re.split(r"[\s,]+", s)):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"item {item!r} is not key=value")
        if key in out:
            raise ValueError(f"param '{key}' given twice")
        out[key] = value
    return out, True


def parse_params(cls, text: str):
    """An instance of the dataclass ``cls`` from a param_str; ValueError says what is wrong."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"Params must be a dataclass, got {cls!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    raw, is_text = _pairs(text)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"unknown param(s) {', '.join(unknown)}; this layer takes: "
                         f"{', '.join(fields) or 'none'}")
    missing = [n for n, f in fields.items() if n not in raw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"missing required param(s): {', '.join(missing)}")
    return cls(**{k: _coerce(k, hints[k], v, is_text) for k, v in raw.items()})
