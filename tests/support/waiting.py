"""Waiting on a condition instead of sleeping a fixed time: `wait_until(predicate, ...)` polls
until the predicate holds and fails with a clear error when it does not within the timeout."""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float = 10.0, interval_s: float = 0.05,
               what: str | None = None) -> T:
    """Call `predicate` every `interval_s` until it returns something truthy, and return that;
    raise TimeoutError (naming `what`, or the predicate, and its last value) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what or _name(predicate)} not true within {timeout_s:g} s "
                               f"(last value: {value!r})")
        time.sleep(interval_s)


async def wait_until_async(predicate: Callable[[], T | Awaitable[T]], timeout_s: float = 10.0,
                           interval_s: float = 0.05, what: str | None = None) -> T:
    """`wait_until` inside an event loop: `predicate` may be a plain or an async function, and
    the loop keeps running between calls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what or _name(predicate)} not true within {timeout_s:g} s "
                               f"(last value: {value!r})")
        await asyncio.sleep(interval_s)


def _name(predicate: Callable) -> str:
    return getattr(predicate, "__qualname__", repr(predicate))
