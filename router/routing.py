"""Which replicas serve a request: typed loads and routes, and the pluggable policies.

`kv_aware` (the default) scores every available candidate like Dynamo's KV router:

    cost = prefill_weight × (prompt blocks − blocks of the prompt's prefix it holds)
           + KV blocks it has in use

where a block the replica's node holds in its KV host tier (docs/kv_tiers.md: past the GPU
prefix, loaded instead of computed) counts HOST_HIT_COST of a block to prefill: a host-tier hit
scores below a GPU hit and above a miss. It takes the cheapest: first a decode replica, then, when the prompt's uncached part on that
D reaches `conditional_disagg_threshold` tokens, a prefill replica (otherwise D prefills the
prompt itself: conditional disaggregation; also when no prefill replica is available).

Every input comes from the engines, so any number of router replicas, each seeing only its
own routes, route alike over the same engines: loads are the replicas' reports, polled by the
router (LoadMonitor, router/streams.py), and which prefixes a replica holds is what its prefix
cache reported storing and evicting (PrefixReport: the block hashes `prefix_block_hashes`
computes from a prompt, as incremental changes after the cursor this policy hands the poll,
`prefix_cursors`). Between two polls the policy adds its own recent routes (the blocks routed
to each replica, and their prefixes until a report lists them), so a burst does not all land
on one replica and a prefix's repeats follow it to where it went first.

Which replicas may be picked is `set_available` (the controller publishes the READY ones; all
of RoutingInputs' replicas until then): no available decode replica raises
NoReplicaAvailable.

No Ray import here: the policies run in the router and in tests; the loads they observe are
the engine actors' reports (ReplicaLoad, actors/messages.py).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from actors.messages import PrefixReport, ReplicaLoad
from pd_cluster.block_allocator import prefix_block_hashes
from pd_cluster.role import Role

Key = tuple[Role, int]   # (role, replica id)
# Own routes kept per replica until the replica has reported its KV cache size.
DEFAULT_RECORD_BLOCKS = 4096
# How long a prefix this router routed somewhere counts as held there without a report
# listing it: covers the request's wait and prefill plus a poll (LOAD_POLL_S); past that it
# failed, was aborted or its blocks were evicted again.
ROUTE_TTL_S = 10.0
# What a prompt block found in the replica's node's host tier costs, in blocks to prefill: a
# copy from host memory, several times cheaper than computing it on a GPU, but not free (its
# bytes cross PCIe, and the tier may have dropped it by the time the request arrives).
HOST_HIT_COST = 0.5


class NoReplicaAvailable(LookupError):
    """No decode replica is available to take a request (none is READY)."""


@dataclass(frozen=True, slots=True)
class Route:
    """The replicas chosen for one request."""

    decode_id: int                      # decodes (and, in colocated mode, prefills) it
    prefill_id: int | None = None       # None: the decode replica prefills it itself


@dataclass(frozen=True, slots=True)
class RoutingInputs:
    """The policy's view of a request and the deployment."""

    num_prefill: int
    num_decode: int
    block_size: int
    prefill_weight: float = 1.0
    conditional_disagg_threshold: int = 0


class RoutingPolicy(ABC):
    """Picks a Route per request among the available replicas; `observe` feeds it the
    replicas' latest loads, `prefix_cursors` says which prefix reports the next poll asks."""

    def __init__(self, inputs: RoutingInputs) -> None:
        self.inputs = inputs
        self._available = {Role.DECODE: list(range(inputs.num_decode)),
                           Role.PREFILL: list(range(inputs.num_prefill))}

    @abstractmethod
    def route(self, prompt_ids: Sequence[int], salt: str | None = None) -> Route:
        """The replicas for a prompt (its blocks hashed under the request's cache salt);
        raises NoReplicaAvailable without a decode replica."""

    def observe(self, loads: Sequence[ReplicaLoad]) -> None:
        """New load reports (the default policy ignores them)."""

    def prefix_cursors(self) -> dict[Key, int]:
        """Per replica, the `prefix_since` of its next load poll (-1: send everything);
        replicas left out report no prefixes (the default policy needs none)."""
        return {}

    def set_available(self, keys: Collection[Key]) -> None:
        """Route only to these (role, replica id) from now on, e.g. the READY replicas."""
        available: dict[Role, list[int]] = {Role.DECODE: [], Role.PREFILL: []}
        for role, replica_id in keys:
            if role not in available:
                raise ValueError(f"unknown replica role {role!r} in {(role, replica_id)}")
            available[role].append(replica_id)
        self._available = {role: sorted(ids) for role, ids in available.items()}

    def available(self, role: Role) -> list[int]:
        """The available replica ids of `role`, ascending."""
        return self._available[role]

    def _decode_ids(self) -> list[int]:
        ids = self._available[Role.DECODE]
        if not ids:
            raise NoReplicaAvailable("no decode replica is available")
        return ids


class RoundRobinPolicy(RoutingPolicy):
    """Cycles through the available D and P replicas independently; prompts shorter than the
    threshold stay on D."""

    def __init__(self, inputs: RoutingInputs) -> None:
        super().__init__(inputs)
        self._turns = {Role.DECODE: 0, Role.PREFILL: 0}

    def route(self, prompt_ids: Sequence[int], salt: str | None = None) -> Route:
        decode_id = self._next(Role.DECODE, self._decode_ids())
        prefill_ids = self.available(Role.PREFILL)
        if not prefill_ids or len(prompt_ids) < self.inputs.conditional_disagg_threshold:
            return Route(decode_id)
        return Route(decode_id, self._next(Role.PREFILL, prefill_ids))

    def _next(self, role: Role, ids: list[int]) -> int:
        turn = self._turns[role]
        self._turns[role] = turn + 1
        return ids[turn % len(ids)]


class ReplicaPrefixes:
    """One router's view of the block hashes one replica's prefix cache holds.

    Lifecycle: nothing known (cursor -1, so the next poll asks a snapshot) → the replica's
    snapshot fills `cached` → each later report, the changes after `cursor`, applies to it;
    a report under a new epoch (a restarted engine) replaces it, and a late or inconsistent
    one is ignored or makes the next poll ask a snapshot again. Between reports the prefixes
    this router routed there also count as held (`routed`), until a report lists them stored
    or ROUTE_TTL_S has passed.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity                # most own routes kept (the replica's blocks)
        self.epoch: int | None = None
        self.cursor = -1
        self.cached: set[int] = set()           # as of `cursor`, from the replica's reports
        self.host: set[int] = set()             # in its node's host tier, as of `cursor`
        self.routed: OrderedDict[int, float] = OrderedDict()   # hash -> when, oldest first

    def overlap(self, hashes: Sequence[int], now: float) -> int:
        """Number of leading `hashes` held (hashes are chained: a gap ends the prefix)."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                when = self.routed.get(h)
                if when is None or now - when > ROUTE_TTL_S:
                    break
            n += 1
        return n

    def host_overlap(self, hashes: Sequence[int], start: int) -> int:
        """Number of `hashes` from `start` on that the node's host tier holds, in a row."""
        n = start
        while n < len(hashes) and hashes[n] in self.host:
            n += 1
        return n - start

    def add_route(self, hashes: Sequence[int], now: float) -> None:
        """A prompt with these block hashes was routed here: it will hold them."""
        for h in hashes:
            if h not in self.cached:
                self.routed[h] = now
                self.routed.move_to_end(h)
        self._expire(now)

    def apply(self, report: PrefixReport, now: float) -> None:
        """Fold in one of the replica's reports (see the class docstring)."""
        if report.epoch != self.epoch:
            self.epoch = report.epoch
            self.cached = set(report.stored)
            self.host = set(report.offloaded)
            # Changes after a cursor of its predecessor mean nothing for what we knew and are
            # not all it holds: keep them, ask for everything next.
            self.cursor = report.cursor if report.snapshot else -1
        elif report.cursor < self.cursor:
            return                                  # older than what we have (polls overlapped)
        elif report.snapshot:
            self.cached = set(report.stored)
            self.host = set(report.offloaded)
            self.cursor = report.cursor
        else:
            self.cached.update(report.stored)
            self.cached.difference_update(report.removed)
            self.host.update(report.offloaded)
            self.host.difference_update(report.unloaded)
            # Changes after a cursor newer than ours leave a gap: ask for everything next.
            self.cursor = report.cursor if report.since <= self.cursor else -1
        for h in report.stored:                     # reported now: no longer a guess
            self.routed.pop(h, None)
        self._expire(now)

    def _expire(self, now: float) -> None:
        routed = self.routed
        while routed and (len(routed) > self.capacity
                          or now - next(iter(routed.values())) > ROUTE_TTL_S):
            routed.popitem(last=False)


@dataclass(slots=True)
class _Replica:
    """What the policy knows of one replica."""

    prefixes: ReplicaPrefixes
    used: int = 0              # KV blocks in use at its last report
    routed_blocks: int = 0     # blocks this router routed there since that report


class KvAwarePolicy(RoutingPolicy):
    """Dynamo-style cost routing over the engines' load and prefix reports; see the module
    docstring. `clock`: monotonic seconds (tests pass their own)."""

    def __init__(self, inputs: RoutingInputs,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(inputs)
        self.clock = clock
        self._replicas: dict[Key, _Replica] = {}
        for role, ids in self._available.items():
            for replica_id in ids:
                self._replica((role, replica_id))

    def observe(self, loads: Sequence[ReplicaLoad]) -> None:
        now = self.clock()
        for load in loads:
            replica = self._replica((load.role, load.replica_id))
            replica.used = load.kv_blocks_used
            replica.routed_blocks = 0
            if load.kv_blocks_total:
                replica.prefixes.capacity = load.kv_blocks_total
            if load.prefix is not None:
                replica.prefixes.apply(load.prefix, now)

    def prefix_cursors(self) -> dict[Key, int]:
        return {key: replica.prefixes.cursor for key, replica in self._replicas.items()}

    def set_available(self, keys: Collection[Key]) -> None:
        super().set_available(keys)
        for key in keys:            # a replica new to us: poll its prefixes from now on
            self._replica(key)

    def route(self, prompt_ids: Sequence[int], salt: str | None = None) -> Route:
        bs = self.inputs.block_size
        decode_ids = self._decode_ids()
        # The last prompt token is always computed (a hit never covers it), as in the engine.
        hashes = prefix_block_hashes(prompt_ids[:-1], bs, salt)
        num_blocks = -(-len(prompt_ids) // bs)
        decode_id, overlap = self._cheapest(Role.DECODE, decode_ids, hashes, num_blocks)
        self._assign((Role.DECODE, decode_id), hashes, num_blocks)
        uncached = len(prompt_ids) - overlap * bs
        prefill_ids = self.available(Role.PREFILL)
        if not prefill_ids or uncached < self.inputs.conditional_disagg_threshold:
            return Route(decode_id)
        prefill_id, _ = self._cheapest(Role.PREFILL, prefill_ids, hashes, num_blocks)
        self._assign((Role.PREFILL, prefill_id), hashes, num_blocks)
        return Route(decode_id, prefill_id)

    def cost(self, role: Role, replica_id: int, hashes: Sequence[int],
             num_blocks: int) -> tuple[float, int]:
        """(cost, prefix blocks held) of sending a prompt of `num_blocks` blocks there: the
        blocks past its GPU prefix that its node's host tier holds count HOST_HIT_COST each."""
        replica = self._replica((role, replica_id))
        overlap = replica.prefixes.overlap(hashes, self.clock())
        in_host = replica.prefixes.host_overlap(hashes, overlap)
        active = replica.used + replica.routed_blocks
        to_prefill = num_blocks - overlap - (1 - HOST_HIT_COST) * in_host
        return self.inputs.prefill_weight * to_prefill + active, overlap

    def _cheapest(self, role: Role, ids: list[int], hashes: Sequence[int],
                  num_blocks: int) -> tuple[int, int]:
        costs = {i: self.cost(role, i, hashes, num_blocks) for i in ids}
        best = min(ids, key=lambda i: costs[i][0])   # ties: the lowest id
        return best, costs[best][1]

    def _assign(self, key: Key, hashes: Sequence[int], num_blocks: int) -> None:
        replica = self._replica(key)
        replica.routed_blocks += num_blocks
        replica.prefixes.add_route(hashes, self.clock())

    def _replica(self, key: Key) -> _Replica:
        replica = self._replicas.get(key)
        if replica is None:
            replica = self._replicas[key] = _Replica(ReplicaPrefixes(DEFAULT_RECORD_BLOCKS))
        return replica


POLICIES: dict[str, type[RoutingPolicy]] = {"kv_aware": KvAwarePolicy,
                                            "round_robin": RoundRobinPolicy}


def make_policy(name: str, inputs: RoutingInputs) -> RoutingPolicy:
    """The policy registered under `name` (router/app_config.py: ROUTING_POLICIES)."""
    if name not in POLICIES:
        raise ValueError(f"routing.policy: unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](inputs)
