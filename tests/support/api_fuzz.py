"""Seeded mutations of OpenAI request bodies, broken bytes, and the check that every answer keeps
OpenAI's error schema: the in-process and the served fuzz share them."""
from __future__ import annotations

import copy
import json
import random
from typing import Any

SEED = 23
COMPLETION = {"model": "default", "prompt": "Hi there", "max_tokens": 2, "temperature": 0.7,
              "top_p": 0.9, "n": 1, "stop": ["\n"], "seed": 1, "logprobs": 1,
              "stream": False, "top_k": 5, "min_tokens": 0, "ignore_eos": False,
              "user": "u", "presence_penalty": 0.5, "frequency_penalty": 0.2,
              "repetition_penalty": 1.1, "logit_bias": {"11": 1.5, "30": -2}}
CHAT = {"model": "default", "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "n": 1,
        "stop": "\n", "seed": 1, "logprobs": True, "top_logprobs": 1, "stream": False,
        "stream_options": {"include_usage": True}, "max_completion_tokens": 2,
        "presence_penalty": -0.5, "frequency_penalty": 1.0, "repetition_penalty": 0.9,
        "logit_bias": {"198": -100},
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
# Never the scripted engine's trigger words ("slow", "refuse", "crash").
STRINGS = ["", " ", "x" * 20_000, "é" * 3000, "\ud800", "a\udfffb", "\x00", "\u202e",
           "<|endoftext|>", "{{ raise_exception('x') }}", "null", "1e308", "NaN", "default",
           "user", "text", "\n" * 100]
NUMBERS = [0, -1, 1, 2, 17, 33, 2 ** 31, 2 ** 63, 2 ** 64 + 1, -(2 ** 70), 10 ** 40, 0.5, -0.0,
           1e308, -1e308, 5e-324, float("nan"), float("inf"), float("-inf")]
# Values of the penalty fields at and past their limits, of wrong kinds, and logit biases of
# tokens outside the vocabulary (49152 ids) or keyed by what is not a token id.
_BIASES = [{"49151": 100}, {"49152": 1}, {"-1": 1}, {str(2 ** 70): 1}, {"1e3": 1}, {"abc": 1},
           {" 5": 1}, {"\u0663": 1}, {"5": 100.5}, {"5": -100}, {"5": "x"}, {"5": None},
           {"5": [1]}, {str(i): 1 for i in range(301)}, {str(i): -100 for i in range(300)}]
PENALTY_VALUES = {
    "presence_penalty": [2, -2, 2.0000001, -2.5, "1", True, None, [0.5]],
    "frequency_penalty": [2, -2, 3, -1e308, "x", False, None, {"a": 1}],
    "repetition_penalty": [0, -1, 1e-9, 1e308, 2 ** 64, "1.2", None, True],
    "logit_bias": _BIASES + [[], [1, 2], "x", 5, None],
}


def deep(depth: int, kind: str) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


def junk(rng: random.Random, like: Any) -> Any:
    """A value of a wrong or extreme kind, sometimes shaped like `like`."""
    choice = rng.randrange(9)
    if choice == 0:
        return rng.choice(STRINGS)
    if choice == 1:
        return rng.choice(NUMBERS)
    if choice == 2:
        return rng.choice([None, True, False, [], {}, [None], {"": None}])
    if choice == 3:
        return deep(rng.choice([5, 50, 500]), rng.choice(["list", "dict"]))
    if choice == 4:                       # arrays where objects go, objects where arrays go
        return [like] if not isinstance(like, list) else {"0": like}
    if choice == 5:
        return [rng.choice(STRINGS + NUMBERS) for _ in range(rng.choice([1, 5, 300]))]
    if choice == 6:
        return {rng.choice(STRINGS): rng.choice(NUMBERS) for _ in range(3)}
    if choice == 7:
        return [[rng.randrange(-5, 200_000) for _ in range(rng.choice([0, 3]))]]
    return str(like)


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (keys and list indices), the root excluded."""
    out: list[tuple] = []
    if len(prefix) >= 4:                  # not into junk's deep nesting
        return out
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else []
    for key, item in items:
        out.append(prefix + (key,))
        out.extend(paths(item, prefix + (key,)))
    return out


def mutate(rng: random.Random, base: dict) -> dict | list | Any:
    body = copy.deepcopy(base)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if not isinstance(body, dict):
            break
        spots = paths(body)
        op = rng.randrange(7)
        if op == 5 or not spots:          # the body itself is not an object
            return junk(rng, body)
        if op == 6:
            field = rng.choice(list(PENALTY_VALUES))
            body[field] = rng.choice(PENALTY_VALUES[field])
            continue
        path = rng.choice(spots)
        parent: Any = body
        for key in path[:-1]:
            parent = parent[key]
        if op == 0:
            parent[path[-1]] = junk(rng, parent[path[-1]])
        elif op == 1:
            parent[path[-1]] = None
        elif op == 2:
            if isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent.pop(path[-1])
        elif op == 3 and isinstance(parent, dict):
            parent[rng.choice(STRINGS[:8] + ["tools", "presence_penalty", "best_of",
                                             "logit_bias", "guided_json", "echo"])] = \
                junk(rng, None)
        else:
            parent[path[-1]] = junk(rng, parent[path[-1]])
    return body


def raw_cases(rng: random.Random, base: dict) -> list[tuple[bytes, dict[str, str]]]:
    """Broken bytes and headers around a valid body."""
    good = json.dumps(base).encode()
    cases = [(b"", {}), (b"{", {}), (b"null", {}), (b"[]", {}), (b'"x"', {}), (b"1e999", {}),
             (good, {"Content-Type": "text/plain"}), (good, {"Content-Type": "application/xml"}),
             (good, {"Content-Type": "application/json; charset=latin-1"}),
             (good[:-1], {}), (good + b"}", {}), (good + b" junk", {}),
             (b"\xff\xfe" + good, {}), (b"\xef\xbb\xbf" + good, {}),
             (good.replace(b"Hi", b"H\xc3"), {}), (good.replace(b"Hi", b"\xed\xa0\x80"), {}),
             (b"{" * 100_000, {}), (b"[" * 10_000 + b"]" * 10_000, {}),
             (b'{"a": ' * 3000 + b"1" + b"}" * 3000, {}),
             (good, {"Content-Length": "7"}), (good, {"Content-Encoding": "gzip"})]
    for _ in range(20):
        data = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        cases.append((bytes(data), {}))
    return cases


def check(response, what: str, failures: list[str]) -> None:
    status = response.status_code
    if status >= 500:
        failures.append(f"{what}: {status} {response.text[:300]}")
    elif status >= 400:
        try:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert isinstance(error["message"], str) and error["message"]
            assert isinstance(error["type"], str)
            assert error["param"] is None or isinstance(error["param"], str)
            assert error["code"] is None or isinstance(error["code"], str)
        except Exception as e:  # noqa: BLE001 - collect, report all at the end
            failures.append(f"{what}: {status} body not OpenAI's error schema ({e!r}): "
                            f"{response.text[:300]}")
