"""Chats' leading ids by their first messages, found on the event loop (issue 24)."""

from __future__ import annotations

from caravan_llm.router.tokens.conversation import ChatPrompt
from caravan_llm.router.tokens.conversation_prefixes import (
    Checkpoint,
    ConversationPrefixes,
    message_chain,
)

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "hello"}
ANSWER = {"role": "assistant", "content": "hi"}
NEXT = {"role": "user", "content": "and then?"}


def chain(*messages: dict[str, str], effort: str | None = None) -> tuple:
    found = message_chain(ChatPrompt(messages=messages, reasoning_effort=effort))
    assert found is not None
    return found


def test_a_chat_and_its_next_turn_share_their_first_links() -> None:
    """The first k links name the first k messages only; any change in them changes the rest."""
    turn1 = chain(SYSTEM, USER)
    turn2 = chain(SYSTEM, USER, ANSWER, NEXT)
    assert [link.digest for link in turn1] == [link.digest for link in turn2[:2]]
    other_system = chain({"role": "system", "content": "You are verbose."}, USER)
    assert not {link.digest for link in other_system} & {link.digest for link in turn2}
    # Same text, another role, key order or template switch: another chat.
    assert chain({"role": "user", "content": "You are terse."})[0] != turn1[0]
    assert chain({"content": "You are terse.", "role": "system"})[0] == turn1[0]
    assert chain(SYSTEM, effort="high")[0].digest != turn1[0].digest
    # add_generation_prompt only changes the text's end: not part of the key.
    flipped = message_chain(ChatPrompt(messages=(SYSTEM, USER), add_generation_prompt=False))
    assert flipped == turn1


def test_the_longest_recorded_prefix_is_found_with_the_text_left_after_it() -> None:
    prefixes = ConversationPrefixes()
    turn1 = chain(SYSTEM, USER)
    ids = tuple(range(100, 140))
    prefixes.record(turn1, ids, (Checkpoint(1, ids=12, chars=30), Checkpoint(2, ids=25, chars=60)))
    turn2 = chain(SYSTEM, USER, ANSWER, NEXT)
    found = prefixes.longest(turn2)
    assert found is not None
    assert (tuple(ids[:25]), 60, 2) == (tuple(found.ids), found.chars, found.messages)
    assert found.rest_chars == turn2[2].chars + turn2[3].chars
    # A new chat with the same system prompt finds the system prompt's ids.
    other = prefixes.longest(chain(SYSTEM, {"role": "user", "content": "something else"}))
    assert other is not None
    assert (tuple(ids[:12]), 1) == (tuple(other.ids), other.messages)
    assert prefixes.longest(chain(USER)) is None


def test_checkpoints_past_the_chat_or_its_ids_are_ignored() -> None:
    prefixes = ConversationPrefixes()
    links = chain(SYSTEM, USER)
    prefixes.record(
        links, (1, 2, 3), (Checkpoint(3, ids=2, chars=5), Checkpoint(1, ids=4, chars=5))
    )
    prefixes.record(links, (1, 2, 3), (Checkpoint(0, ids=1, chars=1),))
    assert 0 == len(prefixes)
    assert prefixes.longest(links) is None


def test_held_ids_are_bounded_least_recently_used_first() -> None:
    prefixes = ConversationPrefixes(max_ids=100)
    chats = [chain({"role": "user", "content": f"chat {n}"}) for n in range(4)]
    for links in chats[:3]:
        prefixes.record(links, tuple(range(40)), (Checkpoint(1, ids=40, chars=80),))
    # Three of 40 ids do not fit in 100: the oldest went.
    assert (2, 80) == (len(prefixes), prefixes.held_ids)
    assert prefixes.longest(chats[0]) is None
    assert prefixes.longest(chats[1]) is not None  # now the most recently used
    prefixes.record(chats[3], tuple(range(40)), (Checkpoint(1, ids=40, chars=80),))
    assert prefixes.longest(chats[2]) is None
    assert prefixes.longest(chats[1]) is not None
    # Recording the same chat again replaces its ids, never counts them twice.
    prefixes.record(chats[1], tuple(range(30)), (Checkpoint(1, ids=30, chars=60),))
    assert 70 == prefixes.held_ids
    # A checkpoint larger than the bound is not kept at all.
    prefixes.record(chats[0], tuple(range(200)), (Checkpoint(1, ids=101, chars=300),))
    assert prefixes.longest(chats[0]) is None


def test_disabled_prefixes_forget_and_find_nothing() -> None:
    prefixes = ConversationPrefixes()
    links = chain(SYSTEM, USER)
    prefixes.record(links, (1, 2, 3), (Checkpoint(2, ids=3, chars=9),))
    prefixes.disable()
    prefixes.record(links, (1, 2, 3), (Checkpoint(2, ids=3, chars=9),))
    assert (0, 0, None) == (len(prefixes), prefixes.held_ids, prefixes.longest(links))


def test_a_message_that_is_not_json_gives_no_chain() -> None:
    assert message_chain(ChatPrompt(messages=({"role": "user", "content": {1, 2}},))) is None
