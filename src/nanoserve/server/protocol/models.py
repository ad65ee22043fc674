"""/v1/models: the one model this server serves, its context length and, as vLLM has them, the
path it was loaded from (`root`) and no `parent` (no adapters); /version."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nanoserve"
    max_model_len: int
    root: str
    parent: str | None = None


class Version(BaseModel):
    version: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
