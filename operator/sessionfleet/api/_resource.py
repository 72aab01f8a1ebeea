"""The root of every custom resource and the metadata the CRD generator needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from sessionfleet.api._common import API_VERSION, GROUP, ObjectMeta


@dataclass(frozen=True)
class PrinterColumn:
    """One column of ``kubectl get`` output."""

    name: str
    json_path: str
    type: Literal["string", "integer", "number", "boolean", "date"]
    description: str
    priority: int = 0


@dataclass(frozen=True)
class KindInfo:
    """Names and presentation of a kind, beside its schema."""

    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    printer_columns: tuple[PrinterColumn, ...] = field(default=())
    categories: tuple[str, ...] = ("sessionfleet",)

    @property
    def crd_name(self) -> str:
        """The CRD's metadata.name, ``<plural>.<group>``."""
        return f"{self.plural}.{GROUP}"


AGE_COLUMN = PrinterColumn(
    "Age", ".metadata.creationTimestamp", "date", "Time since the object was created."
)


class CustomResource(BaseModel):
    """Fields common to the root of every kind. Subclasses add ``spec`` and ``status``."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    info: ClassVar[KindInfo]

    api_version: Literal["sessionfleet.dev/v1alpha1"] = Field(
        default=API_VERSION, alias="apiVersion", description="The API group and version."
    )
    kind: str = Field(description="The kind of the object.")
    metadata: ObjectMeta = Field(
        default_factory=ObjectMeta, description="Standard object metadata."
    )
