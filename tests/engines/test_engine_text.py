"""The simulated engines' tokenizer, chat template and deterministic generator."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from caravan_llm.devcluster.engine.text import (
    ChatMessage,
    count_tokens,
    generated_token,
    generation_key,
    natural_length,
    plan_output,
    render_chatml,
    render_continuation,
    tokenize,
)


def test_tokenize_splits_words_punctuation_and_markers_with_leading_space() -> None:
    """Tokens are words or punctuation with their leading whitespace, and chat markers."""
    assert ["Hello", ",", " world", "!", "<|im_end|>", "\n"] == tokenize(
        "Hello, world!<|im_end|>\n"
    )


@given(st.text(max_size=200))
def test_joining_the_tokens_gives_back_the_text(text: str) -> None:
    """Tokenizing loses nothing: the tokens join into the original text."""
    assert text == "".join(tokenize(text))
    assert len(tokenize(text)) == count_tokens(text)


@given(
    key=st.binary(min_size=16, max_size=16), seed=st.integers(-(2**31), 2**31), n=st.integers(1, 80)
)
def test_generated_text_tokenizes_back_into_the_same_tokens(key: bytes, seed: int, n: int) -> None:
    """A partial reply sent back as text counts as exactly the tokens that made it."""
    tokens = [generated_token(key, seed, i) for i in range(n)]

    assert tokens == tokenize("".join(tokens))


@given(
    prompt=st.text(min_size=1, max_size=50),
    seed=st.integers(0, 1000),
    cut=st.integers(0, 40),
)
def test_a_continuation_yields_the_rest_of_the_uninterrupted_reply(
    prompt: str, seed: int, cut: int
) -> None:
    """Continuing after k tokens produces tokens k, k+1, ... of the whole reply."""
    key = generation_key(prompt)
    natural = natural_length(key, seed, 40)
    whole = plan_output(key=key, seed=seed, start=0, max_new_tokens=100, natural_len=natural)
    k = min(cut, len(whole.tokens))
    rest = plan_output(key=key, seed=seed, start=k, max_new_tokens=100, natural_len=natural)

    assert whole.text == "".join(whole.tokens[:k]) + rest.text
    assert whole.finish_reason == rest.finish_reason == "stop"


def test_different_seeds_or_prompts_give_different_replies() -> None:
    """The reply depends on the prompt and on the seed."""
    key_a = generation_key("a")
    key_b = generation_key("b")

    def reply(key: bytes, seed: int) -> str:
        return plan_output(key=key, seed=seed, start=0, max_new_tokens=20, natural_len=20).text

    assert reply(key_a, 0) == reply(key_a, 0)
    assert reply(key_a, 0) != reply(key_a, 1)
    assert reply(key_a, 0) != reply(key_b, 0)


@given(key=st.binary(min_size=16, max_size=16), seed=st.integers(0, 100), limit=st.integers(1, 500))
def test_natural_length_is_between_half_and_all_of_the_limit(
    key: bytes, seed: int, limit: int
) -> None:
    """EOS comes between half of the output-token limit and the limit itself."""
    length = natural_length(key, seed, limit)

    assert max(1, (limit + 1) // 2) <= length <= limit


def test_max_tokens_cuts_with_length_and_eos_ends_with_stop() -> None:
    """Fewer max tokens than the natural length ends with "length", otherwise "stop"."""
    key = generation_key("prompt")

    short = plan_output(key=key, seed=0, start=0, max_new_tokens=3, natural_len=10)
    full = plan_output(key=key, seed=0, start=0, max_new_tokens=30, natural_len=10)

    assert (3, "length") == (len(short.tokens), short.finish_reason)
    assert (10, "stop") == (len(full.tokens), full.finish_reason)


def test_a_stop_string_ends_the_text_right_before_it() -> None:
    """The text stops before the first stop string, which may fall inside a token."""
    key = generation_key("prompt")
    whole = plan_output(key=key, seed=0, start=0, max_new_tokens=30, natural_len=30).text
    stop = whole[10:14]

    cut = plan_output(key=key, seed=0, start=0, max_new_tokens=30, natural_len=30, stop=[stop])

    assert whole[: whole.find(stop)] == cut.text
    assert "stop" == cut.finish_reason


def test_chatml_rendering_and_continuation() -> None:
    """ChatML closes every turn and opens the reply; a continuation leaves the last turn open."""
    messages = [ChatMessage("user", "hi"), ChatMessage("assistant", "Hel")]

    assert (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHel<|im_end|>\n"
        "<|im_start|>assistant\n"
    ) == render_chatml(messages, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHel" == render_continuation(
        messages
    )
