"""Typed dataclasses to and from plain JSON, so that a report read back is the report written.

One generic walker over the type hints instead of a hand-written ``to_dict``/``from_dict`` per
class: a new field is serialized the moment it is declared. Handles dataclasses, lists, tuples,
dicts with string keys, ``X | None``, Literals and the JSON scalars; anything else is a bug in the
declaring class, and raises.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, Union

T = TypeVar("T")


NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def to_plain(value: Any, unknown: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass tree as JSON-ready dicts and lists (field order kept); NaN and infinities as the
    strings "NaN", "Infinity", "-Infinity", so that the JSON is strict (any parser reads it). A value
    of no JSON type is kept as it is, or given to ``unknown`` (``str``: what a contract states of an
    engine's object it cannot hold as JSON)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name), unknown) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_plain(v, unknown) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_plain(v, unknown) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if unknown is None or value is None or isinstance(value, (bool, int, float, str)):
        return value
    return unknown(value)


def stated(value: Any) -> Any:
    """A value as a trace's contract states it: JSON-ready (``to_plain``), what JSON cannot hold as
    its ``str()`` (an engine's enum, path or config object)."""
    return to_plain(value, unknown=str)


def from_plain(cls: type[T], data: Any) -> T:
    """The inverse of ``to_plain`` for a dataclass ``cls``; raises ValueError on a shape mismatch."""
    return _read(cls, data, cls.__name__)


def _read(tp: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if data is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _read(option, data, where)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError("; ".join(errors))
    if origin is typing.Literal:
        if data not in typing.get_args(tp):
            raise ValueError(f"{where}: {data!r} is not one of {typing.get_args(tp)}")
        return data
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_read(item, v, f"{where}[{i}]") for i, v in enumerate(_expect(data, list, where))]
    if origin is tuple:
        args = typing.get_args(tp)
        items = _expect(data, list, where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_read(args[0], v, f"{where}[{i}]") for i, v in enumerate(items))
        if len(items) != len(args):
            raise ValueError(f"{where}: expected {len(args)} items, got {len(items)}")
        return tuple(_read(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, items)))
    if origin is dict:
        _, value_type = typing.get_args(tp)
        return {k: _read(value_type, v, f"{where}.{k}") for k, v in _expect(data, dict, where).items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        fields = _expect(data, dict, where)
        hints = typing.get_type_hints(tp)
        known = {f.name for f in dataclasses.fields(tp) if f.init}
        unknown = set(fields) - known
        missing = known - set(fields)  # to_plain writes every field: a file lacking one is not ours
        if unknown or missing:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
        return tp(**{name: _read(hints[name], v, f"{where}.{name}") for name, v in fields.items()})
    if tp is float:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return float(data)
        if isinstance(data, str) and data in NON_FINITE:
            return NON_FINITE[data]
        raise ValueError(f"{where}: expected a number, got {data!r}")
    if tp in (int, str, bool):
        if isinstance(data, tp) and not (tp is int and isinstance(data, bool)):
            return data
        raise ValueError(f"{where}: expected {tp.__name__}, got {data!r}")
    raise TypeError(f"{where}: cannot read type {tp!r}")


def _expect(data: Any, kind: type, where: str) -> Any:
    if not isinstance(data, kind):
        raise ValueError(f"{where}: expected a JSON {kind.__name__}, got {type(data).__name__}")
    return data


def dumps(value: Any, indent: int | None = 1) -> str:
    """A dataclass tree as strict JSON (``to_plain``)."""
    import json

    return json.dumps(to_plain(value), indent=indent, allow_nan=False)


def loads_versioned(cls: type[T], text: str, key: str, version: int, what: str) -> T:
    """The ``cls`` that ``dumps`` wrote, when its ``key`` field is ``version``; ValueError for another
    version ("<what> version 3: this tracediff reads version 4") or shape."""
    import json

    data = json.loads(text)
    found = data.get(key) if isinstance(data, dict) else None
    if found != version:
        raise ValueError(f"{what} version {found!r}: this tracediff reads version {version}")
    return from_plain(cls, data)
