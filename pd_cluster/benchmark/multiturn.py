"""`pd-cluster bench --multi-turn`: conversations that come back, the load a KV cache
hierarchy is for (issue 47).

Every conversation opens with the same system prompt; each of its turns re-sends the whole
context so far (system prompt, the earlier user messages and the model's earlier answers, as
streamed) plus a new user message, after a think time. Turn k's prompt is therefore turn
k-1's prompt + its answer + one message: a server that kept turn k-1's KV serves all but the
tail from cache (usage.prompt_tokens_details.cached_tokens says how much), one that evicted
it recomputes the whole context. With more conversations in progress than the GPU's KV cache
holds, what the cache tiers below the GPU keep decides the later turns' TTFT.

Load: `concurrency` conversations in progress at once (each worker starts the next one when
its last ends), or new conversations arriving at `rate` per second (Poisson). Prompts are the
load generator's common words, about a token each (loadgen.make_prompt); with `chat` the
context goes as a list of messages.

The report is summarize()'s (TTFT / TPOT / ITL / e2e, throughput, goodput under both SLOs)
over every request, and the same per turn index, with the prompt tokens cached.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from pd_cluster.benchmark.client import Endpoint, RequestRecord, send
from pd_cluster.benchmark.loadgen import make_prompt
from pd_cluster.benchmark.metrics import distribution, summarize
from pd_cluster.tuning.slo import SLO
from pd_cluster.tuning.workload import arrival_times


@dataclass(frozen=True, slots=True)
class MultiTurnSettings:
    """The conversations and their load."""

    conversations: int = 32
    turns: int = 4
    system_tokens: int = 512            # the system prompt every conversation shares
    user_tokens: int = 64               # each new user message
    output_tokens: int = 128            # each answer (max_tokens; ignore_eos)
    think_time: float = 1.0             # mean seconds between an answer and the next message
    concurrency: int | None = None      # conversations in progress at once
    rate: float | None = None           # or new conversations per second (Poisson)
    timeout: float = 300.0              # per request
    max_duration: float = 3600.0        # no request starts after this many seconds
    seed: int = 0

    def context_tokens(self, turn: int) -> int:
        """About how many tokens turn `turn`'s (0-based) prompt holds."""
        return self.system_tokens + (turn + 1) * self.user_tokens + turn * self.output_tokens

    def check(self) -> None:
        """Clear errors for settings that cannot run (named as the command line names them)."""
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of --rate (conversations/s) and --concurrency "
                             "(conversations in progress)")
        if self.rate is not None and not (self.rate > 0 or math.isinf(self.rate)):
            raise ValueError(f"--rate: must be > 0 (or inf), got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency: must be >= 1, got {self.concurrency}")
        for name, least in (("conversations", 1), ("turns", 1), ("user_tokens", 1),
                            ("output_tokens", 1), ("system_tokens", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"--{_flag(name)}: must be >= {least}, "
                                 f"got {getattr(self, name)}")
        if not (self.think_time >= 0 and math.isfinite(self.think_time)):
            raise ValueError(f"--think-time: must be >= 0 seconds, got {self.think_time}")
        for name in ("timeout", "max_duration"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{_flag(name)}: must be > 0")


def _flag(name: str) -> str:
    return {"system_tokens": "system-prompt-tokens", "output_tokens": "output-len"}.get(
        name, name.replace("_", "-"))


@dataclass(slots=True)
class Conversation:
    """One conversation: its user messages, drawn up front, and the answers as they come."""

    index: int
    system: str
    users: list[str]
    answers: list[str] = field(default_factory=list)

    def prompt(self, turn: int) -> str:
        """Completions: the context as one text, each part after a space, so that turn k's
        prompt starts with turn k-1's prompt and answer, word for word."""
        parts = [self.system] if self.system else []
        for k in range(turn):
            parts += [self.users[k], self.answers[k]]
        return " ".join([*parts, self.users[turn]])

    def messages(self, turn: int) -> list[dict]:
        """Chat: the same context as messages (the chat template then frames them)."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for k in range(turn):
            out += [{"role": "user", "content": self.users[k]},
                    {"role": "assistant", "content": self.answers[k]}]
        return [*out, {"role": "user", "content": self.users[turn]}]

    def words(self, turn: int) -> int:
        """Words in turn `turn`'s context (the load generator's words are about a token)."""
        return len(self.prompt(turn).split())


def build_conversations(settings: MultiTurnSettings,
                        rng: np.random.Generator) -> list[Conversation]:
    """Every conversation with the one shared system prompt and its own user messages."""
    system = make_prompt(settings.system_tokens, rng) if settings.system_tokens else ""
    return [Conversation(n, system, [make_prompt(settings.user_tokens, rng)
                                     for _ in range(settings.turns)])
            for n in range(settings.conversations)]


@dataclass(slots=True)
class TurnRecord:
    """A request of a conversation: which one and which turn, and how it went."""

    conversation: int
    turn: int
    record: RequestRecord


async def run_conversations(endpoint: Endpoint, settings: MultiTurnSettings,
                            progress: bool = True) -> tuple[list[TurnRecord], float, float]:
    """Run every conversation; returns their requests in send order, the duration from the
    first send to the last completion, and the perf_counter() the records' `start` counts
    from. A conversation whose turn fails ends there: its next turn would lack the answer."""
    settings.check()
    rng = np.random.default_rng(settings.seed)
    conversations = build_conversations(settings, rng)
    # Think times and (in concurrency mode) each worker's first start, drawn up front so a
    # seed gives the same schedule whatever the server's speed.
    think = rng.exponential(settings.think_time, (settings.conversations, settings.turns)) \
        if settings.think_time > 0 else np.zeros((settings.conversations, settings.turns))
    turns: list[TurnRecord] = []
    bar = tqdm(total=settings.conversations * settings.turns, desc="bench --multi-turn",
               disable=not progress)
    connector = aiohttp.TCPConnector(limit=0)   # concurrency is ours to set, not the connector's
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()

        async def converse(conv: Conversation) -> None:
            for turn in range(settings.turns):
                if turn:
                    await asyncio.sleep(think[conv.index, turn])
                if time.perf_counter() - t0 > settings.max_duration:
                    return
                record = RequestRecord(len(turns), conv.words(turn), settings.output_tokens)
                turns.append(TurnRecord(conv.index, turn, record))
                text: list[str] = []
                request = conv.messages(turn) if endpoint.chat else conv.prompt(turn)
                await send(session, endpoint, record, request, t0, settings.timeout, text)
                bar.update(1)
                if not record.ok:
                    bar.update(settings.turns - turn - 1)
                    return
                conv.answers.append("".join(text).strip())
            return

        if settings.concurrency is not None:
            # Workers start spread over one think time, not all at once: otherwise their
            # first turns, and then every later one, would arrive as a burst.
            starts = rng.uniform(0, settings.think_time, settings.concurrency)
            queue = iter(conversations)

            async def worker(delay: float) -> None:
                await asyncio.sleep(delay)
                for conv in queue:
                    if time.perf_counter() - t0 > settings.max_duration:
                        return
                    await converse(conv)

            await asyncio.gather(*(worker(d) for d in starts[:settings.conversations]))
        else:
            arrivals = arrival_times(settings.conversations, settings.rate, 1.0, rng)

            async def later(conv: Conversation, at: float) -> None:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                if at <= settings.max_duration:
                    await converse(conv)

            await asyncio.gather(*(later(c, a) for c, a in zip(conversations, arrivals)))
    bar.close()
    records = [t.record for t in turns]
    end = max((r.start + (r.e2e or 0.0) for r in records), default=0.0)
    return turns, max(end - min((r.start for r in records), default=0.0), 1e-9), t0


def per_turn(turns: list[TurnRecord], slo: SLO) -> list[dict]:
    """Each turn index's requests: TTFT and TPOT, SLO attainment, prompt tokens and the share
    the server served from cache (None where it reports no cached_tokens)."""
    rows = []
    for turn in sorted({t.turn for t in turns}):
        records = [t.record for t in turns if t.turn == turn]
        done = [r for r in records if r.ok]
        prompt = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
        cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
        rows.append({
            "turn": turn, "requests": len(records), "completed": len(done),
            "ttft": distribution([r.ttft for r in done]),
            "tpot": distribution([r.tpot for r in done if r.output_tokens > 1]),
            "slo_attainment": sum(slo.met(r.ttft, r.tpot) for r in done) / len(records),
            "prompt_tokens_mean": float(np.mean(prompt)) if prompt else None,
            "cached_tokens_mean": float(np.mean(cached)) if cached else None,
            "cached_fraction": (sum(cached) / sum(prompt) if cached and len(cached) ==
                                len(prompt) and sum(prompt) else None)})
    return rows


def report(turns: list[TurnRecord], duration: float, slo: SLO,
           settings: MultiTurnSettings) -> dict:
    """The whole run (metrics.summarize's fields) with per-turn rows and cached tokens."""
    records = [t.record for t in turns]
    out = summarize(records, duration, slo)
    done = [r for r in records if r.ok]
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    finished = {t.conversation for t in turns if t.turn == settings.turns - 1 and t.record.ok}
    out.update({
        "mode": "multi_turn",
        "conversations": settings.conversations,
        "conversations_completed": len(finished),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": sum(cached) if cached else None,
        "cached_fraction": sum(cached) / prompt if cached and prompt else None,
        "per_turn": per_turn(turns, slo),
    })
    return out


def records_json(turns: list[TurnRecord]) -> list[dict]:
    """Every request's record with its conversation and turn (goodput can be recomputed)."""
    return [{"conversation": t.conversation, "turn": t.turn, **asdict(t.record)} for t in turns]


def format_turns(rows: list[dict]) -> str:
    """A per-turn table: TTFT p50 / p90 (ms), prompt and cached tokens, SLO attainment."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    lines = ["turn  done  TTFT p50 ms  TTFT p90 ms  prompt tok  cached tok  SLO met"]
    for r in rows:
        lines.append(f"{r['turn']:4d}  {r['completed']:4d}  {ms(r['ttft']['p50']):>11}  "
                     f"{ms(r['ttft']['p90']):>11}  {num(r['prompt_tokens_mean']):>10}  "
                     f"{num(r['cached_tokens_mean']):>10}  {100 * r['slo_attainment']:6.1f}%")
    return "\n".join(lines)
