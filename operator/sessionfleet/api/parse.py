"""Parse objects read from the API server into models, with a reason when they cannot be.

Controllers call :func:`parse` on every body they act on: an object the schema let
through but the models reject (for instance written before a CEL rule existed) gets a
``Valid=False`` condition whose message names the field, instead of a crash loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from sessionfleet.api._common import Reason
from sessionfleet.api._resource import CustomResource

ResourceT = TypeVar("ResourceT", bound=CustomResource)


@dataclass(frozen=True)
class Parsed(Generic[ResourceT]):
    """The outcome of parsing: the object, or why it could not be parsed."""

    obj: ResourceT | None
    reason: Reason | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        """Whether the object parsed."""
        return self.obj is not None


def describe_errors(error: ValidationError) -> str:
    """Turn a pydantic error into one line per problem, each naming the field path."""
    lines = []
    for problem in error.errors(include_url=False):
        path = ".".join(str(part) for part in problem["loc"]) or "<object>"
        message = problem["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {message}")
    return "; ".join(lines)


def parse(model: type[ResourceT], body: Mapping[str, Any]) -> Parsed[ResourceT]:
    """Parse ``body`` as ``model``; on failure return :attr:`Reason.INVALID_SPEC`."""
    try:
        return Parsed(model.model_validate(dict(body)))
    except ValidationError as error:
        return Parsed(None, Reason.INVALID_SPEC, describe_errors(error))
