"""The simulated vLLM's real tokenizer, when its model directory has one.

`vllm serve DIR` (or `--tokenizer DIR`) with a `tokenizer.json` in DIR, such as
the tiny models' (`caravan_llm.devcluster.tiny_tokenizer`): the simulator then
tokenizes as vLLM does, with HF `tokenizers` and the chat template of
`tokenizer_config.json` (or `chat_template.jinja`) rendered in Jinja's sandbox
with transformers' settings (trim_blocks, lstrip_blocks, `raise_exception`,
the named special tokens). Chats are tokenized without adding special tokens,
completions with them (vLLM's defaults). /tokenize, usage, the prefix cache's
block hashes and the KV events' token ids then carry real ids, so a router
computing digests with the same tokenizer matches this engine exactly.

Without a tokenizer.json the simulator keeps its regex tokenizer
(`caravan_llm.devcluster.engine.text`). This is the simulator's own small
implementation, kept apart from the router's (`caravan_llm.router.tokens`), so
that a test comparing the two compares two readings of the same files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from caravan_llm.devcluster.engine.text import ChatMessage

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class HfTokenizer:
    """A model directory's tokenizer.json and chat template."""

    def __init__(
        self, tokenizer: Tokenizer, template: str | None, variables: dict[str, str]
    ) -> None:
        self._tokenizer = tokenizer
        self._variables = variables
        self._template: jinja2.Template | None = None
        if template is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(template)

    @classmethod
    def from_directory(cls, directory: Path) -> HfTokenizer | None:
        """The tokenizer in `directory`; None when it has no tokenizer.json."""
        path = directory / "tokenizer.json"
        if not path.is_file():
            return None
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        template_file = directory / "chat_template.jinja"
        template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else config.get("chat_template")
        )
        variables = {
            name: value["content"] if isinstance(value, dict) else value
            for name in _SPECIAL_TOKEN_NAMES
            if (value := config.get(name)) is not None
        }
        return cls(
            Tokenizer.from_file(str(path)),
            template if isinstance(template, str) else None,
            variables,
        )

    def render_chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        """The prompt text the chat template makes of these messages."""
        if self._template is None:
            msg = "the model has no chat template"
            raise ValueError(msg)
        return self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            **self._variables,
        )

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)
