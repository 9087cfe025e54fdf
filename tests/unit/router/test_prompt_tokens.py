"""The router's prompt token ids: the chat template and tokenizer as vLLM applies them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from caravan_llm.common.contract import EngineRoute
from caravan_llm.router.tokens.chat_template import ChatTemplate, ChatTemplateError
from caravan_llm.router.tokens.conversation import ChatPrompt, template_messages
from caravan_llm.router.tokens.model_tokenizer import (
    GIL_RELEASE_CHARS,
    ModelTokenizer,
    TokenizerUnavailable,
    estimated_tokens,
    load_model_tokenizer,
)
from caravan_llm.router.tokens.prompt import prompt_token_ids

SYSTEM_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "def f(): pass"},
]
# transformers 5.19's apply_chat_template (vLLM 0.32's venv) on SYSTEM_USER, tiny tokenizer.
SYSTEM_USER_IDS = (
    *(1, 1078, 1282, 201, 59, 575, 555, 2012, 263, 16, 2, 201),
    *(1, 1505, 201, 441, 283, 825, 835, 2, 201, 1, 67, 319, 632, 849, 201),
)
# The same, continuing an assistant message "ret" (continue_final_message).
CONTINUED_IDS = (*SYSTEM_USER_IDS, 266, 86)
# transformers' tokenizer("import os\n").input_ids
IMPORT_OS_IDS = (767, 580, 201)


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer_dir: Path) -> ModelTokenizer:
    return load_model_tokenizer(tiny_tokenizer_dir)


def test_chatml_template_renders_as_transformers(tiny: ModelTokenizer) -> None:
    """The ChatML template renders each message between its markers, then the reply's header."""
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\ndef f(): pass<|im_end|>\n<|im_start|>assistant\n"
    )
    assert expected == tiny.render_chat(ChatPrompt(messages=tuple(SYSTEM_USER)))


def test_chat_ids_equal_transformers_apply_chat_template(tiny: ModelTokenizer) -> None:
    """A chat's ids are the rendered template's, with no special token added around them."""
    payload = {"model": "m", "messages": SYSTEM_USER}
    assert SYSTEM_USER_IDS == prompt_token_ids(tiny, EngineRoute.CHAT_COMPLETIONS, payload)


def test_continued_final_message_is_cut_after_its_text(tiny: ModelTokenizer) -> None:
    """continue_final_message ends the prompt at the last message's text, as transformers does."""
    payload = {
        "messages": [*SYSTEM_USER, {"role": "assistant", "content": "ret"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    assert CONTINUED_IDS == prompt_token_ids(tiny, EngineRoute.CHAT_COMPLETIONS, payload)


def test_completion_text_and_token_prompts(tiny: ModelTokenizer) -> None:
    """A text prompt is tokenized; a token prompt (or a batch of one) is taken as given."""
    assert IMPORT_OS_IDS == prompt_token_ids(
        tiny, EngineRoute.COMPLETIONS, {"prompt": "import os\n"}
    )
    assert (5, 6, 7) == prompt_token_ids(tiny, EngineRoute.COMPLETIONS, {"prompt": [5, 6, 7]})
    assert (5, 6) == prompt_token_ids(None, EngineRoute.COMPLETIONS, {"prompt": [[5, 6]]})


def test_batches_and_unknown_shapes_are_not_exact(tiny: ModelTokenizer) -> None:
    """A batch of prompts, tools, images or a request's own template give None, never a guess."""
    route = EngineRoute.CHAT_COMPLETIONS
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    bodies: list[tuple[EngineRoute, dict[str, Any]]] = [
        (EngineRoute.COMPLETIONS, {"prompt": ["a", "b"]}),
        (route, {"messages": SYSTEM_USER, "tools": [{"type": "function"}]}),
        (route, {"messages": [{"role": "user", "content": [image]}]}),
        (route, {"messages": SYSTEM_USER, "chat_template": "{{ 1 }}"}),
        (route, {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}),
        (EngineRoute.EMBEDDINGS, {"input": "x"}),
    ]
    assert [None] * len(bodies) == [prompt_token_ids(tiny, r, body) for r, body in bodies]


def test_without_tokenizer_only_token_prompts_are_exact() -> None:
    """A model with no tokenizer has no chat ids and no text-prompt ids."""
    assert prompt_token_ids(None, EngineRoute.CHAT_COMPLETIONS, {"messages": SYSTEM_USER}) is None
    assert prompt_token_ids(None, EngineRoute.COMPLETIONS, {"prompt": "x"}) is None


def test_anthropic_system_and_text_blocks_become_the_chat(tiny: ModelTokenizer) -> None:
    """/v1/messages: top-level system blocks join into one system message, as vLLM converts them."""
    payload = {
        "system": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "def f(): pass"}]}],
    }
    assert SYSTEM_USER_IDS == prompt_token_ids(tiny, EngineRoute.MESSAGES, payload)


def test_responses_instructions_and_input_become_the_chat(tiny: ModelTokenizer) -> None:
    """/v1/responses: instructions are the system prompt, input text the user message."""
    payload = {"instructions": "You are terse.", "input": "def f(): pass"}
    assert SYSTEM_USER_IDS == prompt_token_ids(tiny, EngineRoute.RESPONSES, payload)


def test_text_parts_join_with_newlines_for_a_string_template() -> None:
    """A string-format template sees a message's text parts joined with newlines (vLLM)."""
    prompt = ChatPrompt(
        messages=({"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},)
    )
    expected = [{"role": "user", "content": "a\nb"}]
    assert expected == template_messages(
        prompt, content_format="string", knows_developer_role=False
    )


def test_content_loop_makes_an_openai_format_template() -> None:
    """A template that loops over a message's content gets content as text parts (vLLM's rule)."""
    looping = ChatTemplate(
        "{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}"
        "{% endfor %}{% endfor %}"
    )
    plain = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert ("openai", "string") == (looping.content_format, plain.content_format)


def test_developer_messages_merge_into_the_system_prompt_for_a_template_without_them() -> None:
    """vLLM turns developer into system and merges every system message, first, with blank lines."""
    prompt = ChatPrompt(
        messages=(
            {"role": "system", "content": "s"},
            {"role": "developer", "content": "d"},
            {"role": "user", "content": "u"},
        )
    )
    expected = [{"role": "system", "content": "s\n\nd"}, {"role": "user", "content": "u"}]
    assert expected == template_messages(
        prompt, content_format="string", knows_developer_role=False
    )


def test_template_raise_exception_is_not_exact(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """A template that raises on a conversation makes the request not exact, not an error."""
    source = "{{ raise_exception('no system here') }}"
    with pytest.raises(ChatTemplateError, match="no system here"):
        ChatTemplate(source).render(
            [], add_generation_prompt=True, continue_final_message=False, variables={}
        )
    (tmp_path / "tokenizer.json").write_bytes((tiny_tokenizer_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    payload = {"messages": SYSTEM_USER}
    tokenizer = load_model_tokenizer(tmp_path)
    assert prompt_token_ids(tokenizer, EngineRoute.CHAT_COMPLETIONS, payload) is None


def test_template_sees_special_tokens_and_trims_blocks(
    tmp_path: Path, tiny_tokenizer_dir: Path
) -> None:
    """bos_token from tokenizer_config reaches the template, and block tags eat their newline."""
    (tmp_path / "tokenizer.json").write_bytes((tiny_tokenizer_dir / "tokenizer.json").read_bytes())
    template = (
        "{{ bos_token }}{% for m in messages %}\n  {% if m %}{{ m['content'] }}{% endif %}\n"
        "{% endfor %}"
    )
    config = {"bos_token": {"content": "<|endoftext|>"}, "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_model_tokenizer(tmp_path)
    rendered = tokenizer.render_chat(ChatPrompt(messages=({"role": "user", "content": "x"},)))
    assert "<|endoftext|>x" == rendered


def test_chat_template_jinja_file_wins_over_the_config(
    tmp_path: Path, tiny_tokenizer_dir: Path
) -> None:
    """chat_template.jinja, as transformers 5 saves it, is read before tokenizer_config's."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_tokenizer_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tokenizer = load_model_tokenizer(tmp_path)
    assert "x!" == tokenizer.render_chat(ChatPrompt(messages=({"role": "user", "content": "x"},)))


def test_directory_without_tokenizer_json_is_unavailable(tmp_path: Path) -> None:
    """A directory with no tokenizer.json says so."""
    with pytest.raises(TokenizerUnavailable, match=r"no tokenizer\.json"):
        load_model_tokenizer(tmp_path)


_TEXT = st.lists(
    st.sampled_from(["a", "bc", " ", "\n", "  ", "é", "<|im_end|>", "<|im_start|>", "1", "def"]),
    max_size=30,
).map("".join)


@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), _TEXT), min_size=1, max_size=6
    )
)
def test_segment_cache_gives_the_ids_of_whole_text_tokenizing(
    tiny: ModelTokenizer, turns: list[tuple[str, str]]
) -> None:
    """Ids built from cached pieces between special tokens equal tokenizing the whole text."""
    prompt = ChatPrompt(messages=tuple({"role": role, "content": text} for role, text in turns))
    assert tiny.chat_ids(prompt, use_cache=False) == tiny.chat_ids(prompt)
    # Twice: the second time from the cache.
    assert tiny.chat_ids(prompt, use_cache=False) == tiny.chat_ids(prompt)


def test_later_turns_reuse_the_cached_history(tiny: ModelTokenizer) -> None:
    """A conversation's next turn tokenizes only its new text; the history comes from the cache."""
    history = [{"role": "system", "content": "long shared system prompt " * 20}]
    tiny.chat_ids(ChatPrompt(messages=tuple(history)))
    before = tiny.segment_stats
    next_turn = ChatPrompt(
        messages=(*history, {"role": "user", "content": "a brand new question " * 5})
    )
    tiny.chat_ids(next_turn)
    after = tiny.segment_stats
    assert (1, 1) == (after.hits - before.hits, after.misses - before.misses)


def test_a_new_turn_hands_over_the_cached_historys_ids_before_tokenizing_it(
    tiny_tokenizer_dir: Path,
) -> None:
    """`on_prefix` gets the ids of the cached history once, a prefix of the whole prompt's."""
    tokenizer = load_model_tokenizer(tiny_tokenizer_dir)
    history = [{"role": "system", "content": "a shared system prompt, long enough " * 10}]
    tokenizer.chat_ids(ChatPrompt(messages=tuple(history)))
    next_turn = ChatPrompt(
        messages=(*history, {"role": "user", "content": "a question nobody asked before " * 5})
    )
    handed: list[tuple[tuple[int, ...], int]] = []

    ids = tokenizer.chat_ids(next_turn, on_prefix=lambda *args: handed.append(args))
    again: list[tuple[tuple[int, ...], int]] = []
    tokenizer.chat_ids(next_turn, on_prefix=lambda *args: again.append(args))

    # Everything before the new turn's first piece: the system turn and the user's marker.
    text = tokenizer.render_chat(next_turn)
    cut = text.index("<|im_start|>user") + len("<|im_start|>")
    expected = tokenizer.encode(text[:cut], add_special_tokens=False, use_cache=False)
    assert [expected] == [leading for leading, _ in handed]
    assert expected == ids[: len(expected)]
    # The whole prompt's count, predicted at the leading part's tokens per character.
    ((_, predicted),) = handed
    assert predicted == estimated_tokens(len(expected), cut, len(text))
    assert 0.8 * len(ids) <= predicted <= 1.25 * len(ids)
    assert [] == again  # every piece cached: the whole answer comes as fast


def test_the_whole_prompts_count_is_predicted_at_the_leading_parts_rate() -> None:
    """3 tokens in 6 characters: 6 more characters are 3 more tokens (rounded up)."""
    assert 6 == estimated_tokens(3, 6, 12)
    assert 4 == estimated_tokens(3, 6, 7)  # one more character: half a token, rounded up
    assert 3 == estimated_tokens(3, 6, 6)  # nothing past the leading part
    assert 3 == estimated_tokens(3, 0, 10)  # no characters to take a rate from


@given(text=st.text(min_size=GIL_RELEASE_CHARS, max_size=3 * GIL_RELEASE_CHARS))
def test_long_texts_tokenized_without_the_gil_give_encodes_ids(
    tiny: ModelTokenizer, tiny_tokenizer_dir: Path, text: str
) -> None:
    """Texts tokenized through encode_batch (the GIL let go) give Tokenizer.encode's ids."""
    raw = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    for add_special_tokens in (False, True):
        expected = tuple(raw.encode(text, add_special_tokens=add_special_tokens).ids)
        assert expected == tiny.encode(text, add_special_tokens=add_special_tokens, use_cache=False)


def test_checkpoints_name_the_ids_a_later_turn_begins_with(tiny: ModelTokenizer) -> None:
    """A chat's checkpoints: the ids of its first messages, the same in its next turn."""
    system = {"role": "system", "content": "a shared system prompt " * 8}
    turn1 = ChatPrompt(messages=(system, {"role": "user", "content": "first question " * 4}))
    ids, checkpoints = tiny.chat_checkpoints(turn1)
    assert ids == tiny.chat_ids(turn1, use_cache=False)
    assert [1, 2] == [checkpoint.messages for checkpoint in checkpoints]
    answer = {"role": "assistant", "content": "an answer"}
    turn2 = ChatPrompt(messages=(*turn1.messages, answer, {"role": "user", "content": "more"}))
    turn2_ids = tiny.chat_ids(turn2, use_cache=False)
    other = ChatPrompt(messages=(system, {"role": "user", "content": "another chat"}))
    other_ids = tiny.chat_ids(other, use_cache=False)
    by_count = {checkpoint.messages: checkpoint for checkpoint in checkpoints}
    # The whole first turn (to its last <|im_end|>) begins the second turn's ids...
    whole = by_count[2]
    assert ids[: whole.ids] == turn2_ids[: whole.ids]
    assert tiny.render_chat(turn1)[: whole.chars].endswith("<|im_end|>")
    assert ids[whole.ids - 1] == 2  # <|im_end|>
    assert whole.ids > by_count[1].ids
    # ... and the system prompt alone begins any chat opening with it.
    assert ids[: by_count[1].ids] == other_ids[: by_count[1].ids]


def test_a_continued_final_message_gives_no_checkpoint_for_the_whole_chat(
    tiny: ModelTokenizer,
) -> None:
    """Its last message is left open: the chat rendered closed is not a prefix of it."""
    chat = ChatPrompt(
        messages=(*SYSTEM_USER, {"role": "assistant", "content": "ret"}),
        add_generation_prompt=False,
        continue_final_message=True,
    )
    ids, checkpoints = tiny.chat_checkpoints(chat)
    assert CONTINUED_IDS == ids
    assert [1] == [checkpoint.messages for checkpoint in checkpoints]
