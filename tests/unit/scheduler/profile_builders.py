"""Builders for profiles in tests: a valid default with `**overrides`."""

from __future__ import annotations

from typing import Any

from caravan_llm.scheduler.profiles import ModelProfile


def vllm_document(**overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "qwen",
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "engine": "vllm",
        "gpu": {"class": "h100", "count": 1},
    }
    document.update(overrides)
    return document


def llamacpp_document(**overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "tiny",
        "model": "/models/tiny.gguf",
        "engine": "llamacpp",
    }
    document.update(overrides)
    return document


def make_vllm(**overrides: Any) -> ModelProfile:
    return ModelProfile.model_validate(vllm_document(**overrides))


def make_llamacpp(**overrides: Any) -> ModelProfile:
    return ModelProfile.model_validate(llamacpp_document(**overrides))
