"""The router's background loops end when cancelled: a lease renewal whose keepalive answer
arrives in the same instant as its cancellation (asyncio.run's cancel-all at the end of every
test helper call) must not swallow the cancel and renew forever.

The keepalive here is a plain asyncio future completed right before the cancel: a Ray actor
answers at a moment no test controls, and this instant is the one that matters."""
from __future__ import annotations

import asyncio

import pytest

from router.engine_client import answer_within
from router.output_streams import OutputStreams


async def _answer_then_cancel(task: asyncio.Task, answer: asyncio.Future) -> None:
    """Let `task` get to waiting on `answer` (a few turns of the loop), then answer it and
    cancel the task in one step, before the task runs again."""
    for _ in range(3):
        await asyncio.sleep(0)
    answer.set_result(None)
    task.cancel()


def test_a_cancel_that_lands_with_the_answer_is_raised_not_swallowed():
    async def main():
        answer = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(answer_within(answer, 5.0))
        await _answer_then_cancel(task, answer)
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())


def test_no_answer_within_the_timeout_raises_and_cancels_the_call():
    async def main():
        answer = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError, match="no answer within 0.05 s"):
            await answer_within(answer, 0.05)
        assert answer.cancelled()
    asyncio.run(main())


class _Keepalive:
    """An actor handle's `keepalive.remote(sub)`: each call returns a fresh pending answer."""

    def __init__(self) -> None:
        self.answers: list[asyncio.Future] = []

    def remote(self, sub: str) -> asyncio.Future:
        self.answers.append(asyncio.get_running_loop().create_future())
        return self.answers[-1]


class _Actor:
    def __init__(self) -> None:
        self.keepalive = _Keepalive()


def test_a_cancelled_lease_renewal_ends_even_when_its_answer_lands_with_the_cancel():
    async def main():
        streams, actor = OutputStreams(), _Actor()
        streams.lease(("decode", 0), actor)
        _, task = streams._leases[("decode", 0)]
        await asyncio.sleep(0)
        await _answer_then_cancel(task, actor.keepalive.answers[0])
        done, _ = await asyncio.wait({task}, timeout=5.0)
        assert done and task.cancelled(), "the renewal loop outlived its cancellation"
    asyncio.run(main())
