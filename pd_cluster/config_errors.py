"""One-line `ValueError`s out of pydantic's ValidationError, each naming its field's dotted path.

    engine.block_size: must be a power of two, got 12
    limits: unknown key(s) max_tokenz; known keys: max_tokens, max_prompt_tokens, ...

Validators raise plain `ValueError`s: a field validator's text is about its own field, a model
validator's text starts with the (relative) path of the field it blames.
"""
from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def validate_config(cls: type[M], args: Any, where: str) -> M:
    """`cls.model_validate(args)`; a failure is a ValueError naming each bad field.
    `where` names the whole input in errors about it, e.g. "args"."""
    try:
        return cls.model_validate(args)
    except ValidationError as err:
        raise config_error(err, cls, args, where) from None


def config_error(err: ValidationError, cls: type[BaseModel], args: Any,
                 where: str) -> ValueError:
    """One line per problem; unknown keys of one mapping are grouped and the known ones listed."""
    lines: list[str] = []
    unknown: dict[tuple[str, ...], list[str]] = {}
    for e in err.errors():
        path = _input_path(e["loc"], args)
        if e["type"] == "extra_forbidden":
            unknown.setdefault(path[:-1], []).append(path[-1])
            continue
        message = e["msg"].removeprefix("Value error, ")
        if not path and e["type"] == "value_error":     # a model validator's, path included
            lines.append(message)
        else:
            lines.append(f"{'.'.join(path) or where}: {message}, got {e['input']!r}")
    for parent, keys in unknown.items():
        model = _model_at(cls, parent)
        known = ", ".join(model.model_fields) if model else "?"
        lines.append(f"{'.'.join(parent) or where}: unknown key(s) {', '.join(keys)}; "
                     f"known keys: {known}")
    return ValueError("\n".join(lines))


def _input_path(loc: tuple[int | str, ...], args: Any) -> tuple[str, ...]:
    """The error's location as keys of the input: steps that are no key of it (the tags
    pydantic adds for a member of a union) are left out, except a last one (a missing key)."""
    path, node = [], args
    for i, step in enumerate(loc):
        if isinstance(node, Mapping) and step in node:
            path.append(str(step))
            node = node[step]
        elif i == len(loc) - 1 or not isinstance(node, Mapping):
            path.append(str(step))
    return tuple(path)


def _model_at(cls: type[BaseModel], path: tuple[str, ...]) -> type[BaseModel] | None:
    """The model class that validates the mapping at `path` below `cls`."""
    model: type[BaseModel] | None = cls
    for name in path:
        field = model.model_fields.get(name) if model else None
        model = _model_in(field.annotation) if field else None
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The first model class in a type (through unions and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found:
                return found
    return None
