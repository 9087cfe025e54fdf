"""The suite's one deadline loop (tests/polling.py): what it returns and how it fails."""

from __future__ import annotations

import pytest
from polling import eventually


async def test_returns_the_first_truthy_answer_of_a_sync_or_async_check() -> None:
    answers = iter([0, None, "found"])
    assert "found" == await eventually(lambda: next(answers), 5, "a sync answer", interval_s=0)

    async def ready() -> list[int]:
        return [1]

    assert [1] == await eventually(ready, 5, "an async answer", interval_s=0)


async def test_fails_naming_what_and_the_last_answer() -> None:
    async def never() -> dict[str, int]:
        return {}

    with pytest.raises(
        pytest.fail.Exception, match=r"the replica not reached within 0s \(last: \{\}\)"
    ):
        await eventually(never, 0, "the replica", interval_s=0)


class _Falsy:
    """Not there yet, with a very long description."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "x" * 10_000


async def test_a_long_last_answer_is_cut_short() -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        await eventually(_Falsy, 0, "the answer", interval_s=0)
    message = str(failed.value)
    assert message.startswith("the answer not reached within 0s (last: xxx")
    assert message.endswith("...)")
    assert len(message) < 400
