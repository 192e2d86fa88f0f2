"""Typed messages between the router and the engine actors."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from actors.pool_index import Key
from pd_cluster.outputs import CompletionOutput, RequestOutput
from pd_cluster.request import FinishReason
from pd_cluster.role import Role


# Outputs a request's stream may run ahead of its consumer; beyond that the actor waits and
# the engine loop folds the steps that pile up into one output (fewer, larger messages).
STREAM_BACKPRESSURE = 4


@dataclass(frozen=True, slots=True)
class PrefixReport:
    """What an engine's prefix cache stored and removed (full blocks' chained hashes, as
    `prefix_block_hashes` computes them from a prompt), for routers that route on it.

    Lifecycle: a router polls `load(prefix_since=cursor)` with the `cursor` of the last report
    it applied (-1 when it knows nothing of this replica); the engine answers the net changes
    after that cursor, or a snapshot (`since` == -1) of every cached hash when its bounded
    event log no longer reaches back that far. `epoch` names the engine instance: a report
    under a new epoch (a restarted replica) replaces all the router knew of the old one.
    """

    epoch: int              # random id of the engine instance
    since: int              # the changes after this event number; -1: a snapshot
    cursor: int             # number of the last event included: the next poll's prefix_since
    stored: list[int]       # hashes cached now (a snapshot: all of them)
    removed: list[int]      # hashes no longer cached (empty in a snapshot)
    # The KV tiers (docs/kv_tiers.md): hashes the engine's node's host tier took in (a
    # snapshot: all it holds) and dropped, past the GPU cache: a cheaper miss.
    offloaded: list[int] = field(default_factory=list)
    unloaded: list[int] = field(default_factory=list)

    @property
    def snapshot(self) -> bool:
        return self.since < 0


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What one engine replica reports about itself, its `load()` (counters are totals since
    its start)."""

    role: Role
    replica_id: int                     # index among the replicas of its role
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0             # held by requests; cached-but-free blocks count as free
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0           # blocks holding a cached prompt prefix (held or free)
    prefix_queries: int = 0             # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0                # of which were cached
    num_preemptions: int = 0
    kv_bytes_transferred: int = 0       # KV sent (P) or received (D)
    kv_transfer_seconds: float = 0.0    # time spent in those transfers
    transport: str = ""                 # KV transport name ("" when it has none)
    model_loads: int = 0                # models built in the replica's process (a role
                                        # change keeps its weights: this stays 1)
    # Engine steps by kind ("prefill" | "decode" | "mixed"): steps, seconds and the work in
    # them (see pd_cluster.step_totals).
    steps: dict[str, dict[str, float]] = field(default_factory=dict)
    # Speculative decoding counters (pd_cluster/spec_decode/decoder.py: SpecStats.as_dict);
    # empty when the engine does not speculate.
    spec_decode: dict[str, float] = field(default_factory=dict)
    # The prefix cache's changes, when asked for (`load(prefix_since=...)`); else None.
    prefix: PrefixReport | None = None
    # The KV tiers' counters, with kv_tiers on (actors/kv_tier_engine.py: TieredEngine's
    # _tier_report: the engine's loads and offloads, its node's host tier's stats under
    # "host_tier").
    kv_tiers: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KVDestination:
    """A decode engine's reservation of a request's prompt KV: the blocks it goes into (the
    push handoff writes them from the prefill engine; the pool handoff reads them from the
    pool)."""

    descriptor: bytes            # the decode engine's encoded KVDescriptor
    agent: str                   # its transport agent name
    block_ids: list[int]         # blocks for the whole prompt, in order
    num_cached_tokens: int       # prompt tokens the decode engine already holds (not re-sent)


@dataclass(frozen=True, slots=True)
class PushedKV:
    """Push handoff: the prompt KV is in the decode engine's reserved blocks, written there by
    these transfers of the prefill engine."""

    descriptor: bytes                     # the prefill engine's encoded KVDescriptor
    agent: str                            # its transport agent name
    transfer_ids: list[str]               # the writes the decode engine must see completed


@dataclass(frozen=True, slots=True)
class PooledKV:
    """Pool handoff: the prompt KV is in the KV pool, one key per prompt block, held there for
    the decode engine under the request id (it reads the blocks it lacks, then ends the hold)."""

    keys: list[Key]
    stored: bool = True   # False: the pool was lost (its actor died), D prefills it itself
    pool: str = ""        # the Ray node of the pool holding them (one pool per node)


@dataclass(frozen=True, slots=True)
class PrefillTimes:
    """P's stamps of one prefill, monotonic on P's host (wall clock = stamp + wall_offset):
    what a request trace shows of P (router/tracing.py) and the TTFT diagnostics read
    (bench/harness/diagnostics.py, through PrefillSide.stages)."""

    called: float                  # the prefill call reached P
    scheduled: float | None        # P's engine first scheduled it: its queue's end
    prefilled: float               # its first token was out of P's engine
    started: float                 # the handover began (push: once D's blocks were known)
    landed: float                  # the KV was in place
    wall_offset: float             # time.time() - time.monotonic() on P
    transport: str                 # the KV transport's name
    layers: int                    # KV layers moved
    grammar: tuple[float, float] | None = None   # P's engine got it, its grammar was built


@dataclass(frozen=True, slots=True)
class DecodeTimes:
    """D's stamps of taking a prompt's KV over (see PrefillTimes): D.decode's answer."""

    called: float                  # D.decode reached D
    landed: float                  # the KV was in D's blocks; the request joins the batch
    wall_offset: float


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What the prefill engine answers once the prompt KV is where its handoff puts it: the
    request's first token, and where the KV is for the decode engine."""

    first: StreamDelta                    # the first token as the request's stream shows it
                                          # (`StreamDelta.first_token`)
    kv: PushedKV | PooledKV               # where the prompt KV is
    kv_bytes: int                         # bytes it moved
    transfer_s: float                     # from the handover's start to the KV in place
    times: PrefillTimes | None = None     # P's stamps of it

    @property
    def token(self) -> int:
        """The first token's id: the decode engine continues from it."""
        return self.first.token_ids[0]

    @property
    def logprobs(self) -> dict[int, float] | None:
        return self.first.logprobs[0] if self.first.logprobs else None


@dataclass(slots=True)
class StreamDelta:
    """What an engine actor streams for one request: only what is new since the last one.

    Cumulative outputs would re-send the prompt and every token so far on each step, which at
    hundreds of running requests costs more than the step; `StreamAccumulator` rebuilds them
    on the receiving side.
    """

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    num_cached_tokens: int
    error: str | None
    engine_ttft: float | None = None    # RequestOutput.engine_ttft, once known
    # Speculative decoding on this replica so far (RequestOutput.spec_*: totals, not deltas).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    engine_times: tuple | None = None   # RequestOutput.engine_times: on the last delta only

    @classmethod
    def of(cls, out: RequestOutput) -> "StreamDelta":
        o, n = out.outputs[0], len(out.delta_token_ids)
        lps = None if o.logprobs is None else (o.logprobs[-n:] if n else [])
        return cls(list(out.delta_token_ids), out.delta_text, lps, out.finished,
                   o.finish_reason, o.stop_reason, out.num_cached_tokens, out.error,
                   out.engine_ttft, out.spec_proposed_tokens, out.spec_accepted_tokens,
                   out.engine_times)

    @classmethod
    def first_token(cls, out: RequestOutput) -> "StreamDelta":
        """The prefill engine's output of a prompt's first token (finished there: the request
        goes on on a decode engine) as the request's first delta: not finished, and without
        the text a stream holds back after that token (`first_token_text`)."""
        first = cls.of(out)
        first.text, _ = first_token_text(first.text)
        first.finished, first.finish_reason, first.stop_reason = False, None, None
        return first


# The first token's one trip to the caller. P's output of it goes there as soon as P has it
# (StreamDelta.first_token, in the PrefillResult); D, which continues the request from that
# token, leaves its own output of it out of the request's stream (`after_first_token`).
# With stop strings, which D judges on that token's text and the next, the router holds P's
# back instead, and D's stream carries the first token.
#
# A stream holds a token's text back while it ends in an unfinished character (U+FFFD,
# pd_cluster/tokenizer.py: IncrementalDetokenizer); a finished output, as P's of the first
# token is, flushes it. So P's delta shows what a stream would show, and D's stream has the
# rest: with the next tokens, or alone if the request ends at the first token.
UNFINISHED_CHARACTER = "\ufffd"


def first_token_text(text: str) -> tuple[str, str]:
    """The text of a finished output of one token (without stop strings) as (what the
    request's stream shows once the token is out, what it holds back to the next token)."""
    return ("", text) if text.endswith(UNFINISHED_CHARACTER) else (text, "")


def after_first_token(out: RequestOutput) -> RequestOutput | None:
    """D's first output of a request whose first token the caller has (P's): None, unless the
    request ends at that token: then its end, without the token."""
    if not out.finished:
        return None
    return replace(out, delta_token_ids=out.delta_token_ids[1:],
                   delta_text=first_token_text(out.delta_text)[1])


class StreamErrorKind(str, enum.Enum):
    """How a request's stream ended in an error."""

    REJECTED = "rejected"   # the engine refused the request: the client's fault
    FAILED = "failed"       # the engine failed it
    TIMEOUT = "timeout"     # the engine gave up waiting

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class StreamError:
    """A request's stream ended in an error, of this kind."""

    kind: StreamErrorKind
    message: str

    @classmethod
    def of(cls, e: Exception) -> "StreamError":
        kind = (StreamErrorKind.REJECTED if isinstance(e, ValueError)
                else StreamErrorKind.TIMEOUT if isinstance(e, TimeoutError)
                else StreamErrorKind.FAILED)
        return cls(kind, str(e) or type(e).__name__)


class StreamAccumulator:
    """Rebuilds a request's cumulative RequestOutputs from its StreamDeltas (across re-runs
    on other replicas too: a re-run's deltas continue the same stream)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, float]] | None = None
        # The most any engine of the request found cached: P's hits (its prefix cache and,
        # pooled, the KV pool's blocks it read) come in its early token, D's in its deltas.
        self.num_cached_tokens = 0
        # Speculation counts: those of earlier replicas (a re-run starts over at 0), and the
        # current replica's latest.
        self._spec_before = (0, 0)
        self._spec_now = (0, 0)

    def add(self, d: StreamDelta) -> RequestOutput:
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
        self.token_ids += d.token_ids
        self.text += d.text
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or []) + d.logprobs
        choice = CompletionOutput(0, self.text, list(self.token_ids), self.logprobs,
                                  d.finish_reason, d.stop_reason)
        spec = (d.spec_proposed_tokens, d.spec_accepted_tokens)
        if spec[0] < self._spec_now[0]:          # counting anew: another replica's run
            self._spec_before = tuple(a + b for a, b in zip(self._spec_before, self._spec_now))
        self._spec_now = spec
        proposed, accepted = (a + b for a, b in zip(self._spec_before, spec))
        return RequestOutput(self.request_id, self.prompt_token_ids, [choice], d.finished,
                             self.num_cached_tokens, d.text, list(d.token_ids), d.error,
                             d.engine_ttft, proposed, accepted)
