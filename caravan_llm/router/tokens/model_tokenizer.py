"""One model's tokenizer: `tokenizer.json` through HF `tokenizers`, chat template, segment cache.

`load_model_tokenizer(directory)` reads what transformers reads from a model
or tokenizer directory:

- `tokenizer.json` (required): the fast tokenizer, loaded by HF `tokenizers`,
  the same Rust code transformers' `TokenizersBackend` runs inside vLLM;
- `tokenizer_config.json`: the named special tokens (`bos_token`, `eos_token`,
  ... as text or as `{"content": ...}`) the template sees, and `chat_template`
  (a string, or a list of named templates of which `default` is used);
- `chat_template.jinja`, which transformers 5 writes and reads in preference
  to the config's `chat_template`.

A directory without a usable chat template still tokenizes plain prompts
(completions); its chats are not exact.

**Segment cache.** `tokenizers` first cuts the text at every added token
(`<|im_start|>`, `<|im_end|>`, ...), then normalizes, pre-tokenizes and runs
BPE on each piece between them on its own. So the ids of a text are the ids
of its pieces joined, with each added token's id between them, and a piece
seen before (a shared system prompt, every earlier turn of a conversation)
need not be tokenized again. `ModelTokenizer` keeps the ids of recent pieces,
bounded in characters, least recently used dropped first. It uses the cache
only where that identity holds: added tokens that strip no neighbouring
whitespace, match whole text (no `single_word`) and, when the tokenizer
normalizes, are matched on raw text; and no pre-tokenizer that treats the
first piece of a text differently (Metaspace's `prepend_scheme: first`).
Otherwise it tokenizes whole texts, which is always exact.

Not safe for concurrent use from several threads (the cache is plain state):
`caravan_llm.router.tokens.registry.Tokenizers` runs each model's work on one
worker thread.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from caravan_llm.router.tokens.chat_template import ChatTemplate, ChatTemplateError
from caravan_llm.router.tokens.conversation import ChatPrompt, NotExact, template_messages
from caravan_llm.router.tokens.conversation_prefixes import Checkpoint

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# transformers' named special tokens, which every chat template may read.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# About 64 MB of cached text per model at most (ids take about a quarter more).
DEFAULT_SEGMENT_CACHE_CHARS = 16_000_000
# Pieces this short are tokenized again rather than cached (cheaper than the bookkeeping).
MIN_CACHED_SEGMENT_CHARS = 16
# Texts this long are tokenized with the GIL released (`ModelTokenizer._encode`): below it,
# `encode` is cheaper than `encode_batch` and holds the GIL for well under a millisecond.
GIL_RELEASE_CHARS = 1024


# Called with a prompt's leading token ids before the rest is tokenized (`encode`),
# and the whole prompt's token count as they predict it (`estimated_tokens`).
PrefixCallback = Callable[[tuple[int, ...], int], None]


class TokenizerUnavailable(Exception):
    """A directory has no tokenizer the router can load; the message says what is missing."""


@dataclass(frozen=True, slots=True)
class SegmentStats:
    """How the segment cache has done since the tokenizer was loaded."""

    hits: int
    misses: int
    cached_segments: int
    cached_chars: int


class ModelTokenizer:
    """Prompt text to the engine's token ids, for one model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        template: ChatTemplate | None,
        special_tokens: Mapping[str, str],
        segment_cache_chars: int = DEFAULT_SEGMENT_CACHE_CHARS,
    ) -> None:
        self._tokenizer = tokenizer
        self.template = template
        self.special_tokens = dict(special_tokens)
        self._cache_limit = segment_cache_chars
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cached_chars = 0
        self._hits = 0
        self._misses = 0
        spec = json.loads(tokenizer.to_str())
        self._splitter, self._added_ids = _added_token_splitter(spec)
        self._prefix, self._suffix = _special_affixes(spec)
        self.segmentable = self._splitter is not None and _segment_independent(spec)

    @property
    def segment_stats(self) -> SegmentStats:
        return SegmentStats(
            hits=self._hits,
            misses=self._misses,
            cached_segments=len(self._cache),
            cached_chars=self._cached_chars,
        )

    def encode(
        self,
        text: str,
        *,
        add_special_tokens: bool,
        use_cache: bool = True,
        on_prefix: PrefixCallback | None = None,
    ) -> tuple[int, ...]:
        """The ids `tokenizer(text, add_special_tokens=...)` gives in transformers.

        `on_prefix`, with the segment cache in use, is called at most once:
        with the ids found so far, just before the first piece that must be
        tokenized after some ids (a new turn after a cached system prompt and
        history), and with the whole prompt's token count estimated from them
        (`estimated_tokens`). Never when the cache held every piece: the whole
        result comes as fast then.
        """
        if not (use_cache and self.segmentable) or (add_special_tokens and self._prefix is None):
            return self._encode(text, add_special_tokens=add_special_tokens)
        prefix = self._prefix if add_special_tokens and self._prefix is not None else ()
        ids = self._segmented(text, prefix, on_prefix)
        if add_special_tokens and self._prefix is not None and self._suffix is not None:
            return self._prefix + ids + self._suffix
        return ids

    def chat_ids(
        self, prompt: ChatPrompt, *, use_cache: bool = True, on_prefix: PrefixCallback | None = None
    ) -> tuple[int, ...]:
        """The ids vLLM feeds the model for a chat: its template rendered, no special tokens added.

        Raises NotExact when the model has no usable template or the template
        refuses. `on_prefix`: as for `encode`.
        """
        text = self.render_chat(prompt)
        return self.encode(text, add_special_tokens=False, use_cache=use_cache, on_prefix=on_prefix)

    def chat_checkpoints(
        self, prompt: ChatPrompt, *, on_prefix: PrefixCallback | None = None
    ) -> tuple[tuple[int, ...], tuple[Checkpoint, ...]]:
        """`chat_ids` with the segment cache, and how many of the ids the first messages fill.

        Checkpoints (`caravan_llm.router.tokens.conversation_prefixes`) for the
        whole chat and, when it opens with a system prompt, for that alone:
        each is the chat's first k messages rendered without the generation
        prompt, when that text begins the chat's own text, cut after its last
        added token (the ids up to there are the same in any chat that begins
        with the same text). None without the segment cache (it has no cut points).
        """
        text = self.render_chat(prompt)
        if not self.segmentable:
            ids = self.encode(text, add_special_tokens=False, on_prefix=on_prefix)
            return ids, ()
        marks: list[tuple[int, int]] = []
        ids = self._segmented(text, (), on_prefix, marks)
        return ids, self._checkpoints(prompt, text, marks)

    def _checkpoints(
        self, prompt: ChatPrompt, text: str, marks: Sequence[tuple[int, int]]
    ) -> tuple[Checkpoint, ...]:
        messages = prompt.messages
        counts = {len(messages)}
        if len(messages) > 1 and messages[0].get("role") in {"system", "developer"}:
            counts.add(1)
        ends = [end for end, _ in marks]
        checkpoints: list[Checkpoint] = []
        for count in sorted(counts):
            head_prompt = ChatPrompt(
                messages=messages[:count],
                add_generation_prompt=False,
                reasoning_effort=prompt.reasoning_effort,
            )
            try:
                head = self.render_chat(head_prompt)
            except NotExact:
                continue
            if not head or not text.startswith(head):
                continue
            at = bisect.bisect_right(ends, len(head)) - 1
            if at >= 0 and marks[at][1] > 0:
                checkpoints.append(Checkpoint(count, ids=marks[at][1], chars=marks[at][0]))
        return tuple(checkpoints)

    def render_chat(self, prompt: ChatPrompt) -> str:
        """The chat's prompt text; NotExact when it cannot be rendered as the engine would."""
        template = self.template
        if template is None:
            raise NotExact("the model has no chat template")
        messages = template_messages(
            prompt,
            content_format=template.content_format,
            knows_developer_role=template.knows_developer_role,
        )
        variables: dict[str, Any] = dict(self.special_tokens)
        if "reasoning_effort" in template.variables:
            variables["reasoning_effort"] = prompt.reasoning_effort
        if prompt.reasoning_effort is not None and "enable_thinking" in template.variables:
            variables["enable_thinking"] = prompt.reasoning_effort != "none"
        try:
            return template.render(
                messages,
                add_generation_prompt=prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message,
                variables=variables,
            )
        except ChatTemplateError:
            # Not the template's own message: it may quote the conversation, never logged.
            raise NotExact("the chat template refused or failed on the messages") from None

    def _encode(self, text: str, *, add_special_tokens: bool) -> tuple[int, ...]:
        """`Tokenizer.encode`'s ids, letting go of the GIL while a long text is tokenized.

        `Tokenizer.encode` holds the GIL for the whole call (~20 ms at 8k tokens),
        so the router's event loop would stand still while its worker thread
        tokenizes; `encode_batch` of one text gives the same ids with the GIL
        released. Short texts keep `encode`, which is cheaper per call.
        """
        if len(text) < GIL_RELEASE_CHARS:
            return tuple(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return tuple(encoding.ids)

    def _segmented(
        self,
        text: str,
        prefix: tuple[int, ...],
        on_prefix: PrefixCallback | None,
        marks: list[tuple[int, int]] | None = None,
    ) -> tuple[int, ...]:
        """The text's ids, piece by piece; `on_prefix` gets `prefix` + the cached leading ids.

        `marks`, when given, gets (the end of an added token in the text, the
        ids up to and with it) for every added token, in order.
        """
        splitter = self._splitter
        if splitter is None:  # pragma: no cover - segmentable implies a splitter
            return self._encode(text, add_special_tokens=False)
        ids: list[int] = []
        start = 0
        # Each added token's span, then the text's end: the piece before each is plain text.
        cuts: list[tuple[int, int, str | None]] = [
            (match.start(), match.end(), match.group()) for match in splitter.finditer(text)
        ]
        cuts.append((len(text), len(text), None))
        for piece_end, token_end, token in cuts:
            if piece_end > start:
                piece = text[start:piece_end]
                if on_prefix is not None and ids and self._is_miss(piece):
                    # The first piece to tokenize after some ids: hand the ids over now.
                    leading = (*prefix, *ids)
                    on_prefix(leading, estimated_tokens(len(leading), start, len(text)))
                    on_prefix = None
                ids.extend(self._piece(piece))
            if token is not None:
                ids.append(self._added_ids[token])
                if marks is not None:
                    marks.append((token_end, len(ids)))
            start = token_end
        return tuple(ids)

    def _is_miss(self, piece: str) -> bool:
        """Whether the piece will be tokenized for the cache (a long piece it does not hold)."""
        return len(piece) >= MIN_CACHED_SEGMENT_CHARS and piece not in self._cache

    def _piece(self, piece: str) -> tuple[int, ...]:
        if len(piece) < MIN_CACHED_SEGMENT_CHARS:
            return self._encode(piece, add_special_tokens=False)
        cached = self._cache.get(piece)
        if cached is not None:
            self._cache.move_to_end(piece)
            self._hits += 1
            return cached
        self._misses += 1
        ids = self._encode(piece, add_special_tokens=False)
        if len(piece) <= self._cache_limit:
            self._cache[piece] = ids
            self._cached_chars += len(piece)
            while self._cached_chars > self._cache_limit:
                dropped, _ = self._cache.popitem(last=False)
                self._cached_chars -= len(dropped)
        return ids


def estimated_tokens(leading_tokens: int, leading_chars: int, chars: int) -> int:
    """A text's token count, predicted from its first `leading_chars` giving `leading_tokens`.

    The rest of the text is taken to tokenize at the leading part's rate:
    the same model's tokenizer on the same conversation. The router's
    character estimate (`prefix_index.ShapeConfig.chars_per_token`, 4) is
    far off for tokenizers that are not an English BPE (the tiny models' is
    about 1.5 characters a token), and a too small count would make the
    replica holding the leading ids look as if it held the whole prompt.
    """
    if leading_chars <= 0 or chars <= leading_chars:
        return leading_tokens
    return leading_tokens + math.ceil((chars - leading_chars) * leading_tokens / leading_chars)


def _added_token_splitter(spec: Mapping[str, Any]) -> tuple[re.Pattern[str] | None, dict[str, int]]:
    """A pattern matching the added tokens leftmost-longest, as tokenizers cuts at them."""
    added = spec.get("added_tokens") or []
    ids = {token["content"]: int(token["id"]) for token in added if token.get("content")}
    if not ids:
        return None, ids
    # Longest first: at one position the longest token wins, as in tokenizers' matcher.
    alternatives = sorted(ids, key=lambda content: (-len(content), content))
    return re.compile("|".join(re.escape(content) for content in alternatives)), ids


def _segment_independent(spec: Mapping[str, Any]) -> bool:
    """Whether the pieces between added tokens tokenize alone as they do in place."""
    normalizes = spec.get("normalizer") is not None
    for token in spec.get("added_tokens") or []:
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return False
        if normalizes and token.get("normalized"):
            return False
    return not _prepends_first_only(spec.get("pre_tokenizer"))


def _prepends_first_only(node: Any) -> bool:
    if isinstance(node, Mapping):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            return True
        return any(_prepends_first_only(value) for value in node.values())
    if isinstance(node, list):
        return any(_prepends_first_only(value) for value in node)
    return False


def _special_affixes(
    spec: Mapping[str, Any],
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """The ids the post-processor puts around one sequence, when it only adds fixed tokens.

    None, None when it does something else (the caller then lets tokenizers add them).
    """
    processor = spec.get("post_processor")
    if processor is None or processor.get("type") == "ByteLevel":
        return (), ()
    if processor.get("type") != "TemplateProcessing":
        return None, None
    specials = processor.get("special_tokens") or {}
    prefix: list[int] = []
    suffix: list[int] = []
    seen_sequence = False
    for item in processor.get("single") or []:
        if "Sequence" in item:
            if seen_sequence or item["Sequence"].get("id") != "A":
                return None, None
            seen_sequence = True
        elif "SpecialToken" in item:
            token = specials.get(item["SpecialToken"].get("id"))
            if token is None:
                return None, None
            (suffix if seen_sequence else prefix).extend(int(i) for i in token.get("ids", []))
        else:
            return None, None
    if not seen_sequence:
        return None, None
    return tuple(prefix), tuple(suffix)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _chat_template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, Mapping) and entry.get("name") == "default":
                source = entry.get("template")
                return source if isinstance(source, str) else None
    return None


def load_model_tokenizer(
    directory: Path, *, segment_cache_chars: int = DEFAULT_SEGMENT_CACHE_CHARS
) -> ModelTokenizer:
    """The tokenizer in `directory` (blocking file I/O); TokenizerUnavailable says what is wrong."""
    tokenizer_file = directory / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise TokenizerUnavailable(f"no {TOKENIZER_FILE}")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:
        raise TokenizerUnavailable(
            f"{TOKENIZER_FILE} does not load: {type(exc).__name__}"
        ) from None
    config: Mapping[str, Any] = {}
    config_file = directory / TOKENIZER_CONFIG_FILE
    if config_file.is_file():
        try:
            loaded = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerUnavailable(
                f"{TOKENIZER_CONFIG_FILE} is not JSON: {type(exc).__name__}"
            ) from None
        if isinstance(loaded, Mapping):
            config = loaded
    special_tokens = {
        name: text
        for name in SPECIAL_TOKEN_NAMES
        if (text := _token_text(config.get(name))) is not None
    }
    template: ChatTemplate | None = None
    source = _chat_template_source(directory, config)
    if source is not None:
        try:
            template = ChatTemplate(source)
        except ChatTemplateError as exc:
            raise TokenizerUnavailable(str(exc)) from None
    return ModelTokenizer(
        tokenizer,
        template=template,
        special_tokens=special_tokens,
        segment_cache_chars=segment_cache_chars,
    )
