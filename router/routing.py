"""Which replicas serve a request: typed loads and routes, and the pluggable policies.

`kv_aware` (the default) scores every candidate like Dynamo's KV router:

    cost = prefill_weight × (prompt blocks − blocks of the prompt's prefix it holds)
           + KV blocks it has in use

and takes the cheapest: first a decode replica, then, when the prompt's uncached part on that
D reaches `conditional_disagg_threshold` tokens, a prefill replica (otherwise D prefills the
prompt itself: conditional disaggregation). Loads come from the replicas' reports, polled by
the router, plus the blocks routed to each replica since its last report, so a burst between
two polls does not all land on one replica. Which prefixes a replica holds is approximated by
a router-side LRU of the block hashes routed to it, sized like its KV cache.

No Ray import here: the policies run in the router and in tests; the loads they observe are
the engine actors' reports (ReplicaLoad, actors/messages.py).
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from actors.messages import DECODE, PREFILL, ReplicaLoad
from pd_cluster.block_allocator import prefix_block_hashes

# Prefix record size per replica until the replica has reported its KV cache size.
DEFAULT_RECORD_BLOCKS = 4096


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
    """Picks a Route per request; `observe` feeds it the replicas' latest loads."""

    def __init__(self, inputs: RoutingInputs) -> None:
        self.inputs = inputs

    @abstractmethod
    def route(self, prompt_ids: Sequence[int]) -> Route: ...

    def observe(self, loads: Sequence[ReplicaLoad]) -> None:
        """New load reports (the default policy ignores them)."""


class RoundRobinPolicy(RoutingPolicy):
    """Cycles through D and P replicas independently; prompts shorter than the threshold stay
    on D."""

    def __init__(self, inputs: RoutingInputs) -> None:
        super().__init__(inputs)
        self._decode = itertools.cycle(range(inputs.num_decode))
        self._prefill = itertools.cycle(range(inputs.num_prefill))

    def route(self, prompt_ids: Sequence[int]) -> Route:
        decode_id, inputs = next(self._decode), self.inputs
        if not inputs.num_prefill or len(prompt_ids) < inputs.conditional_disagg_threshold:
            return Route(decode_id)
        return Route(decode_id, next(self._prefill))


class PrefixRecord:
    """LRU set of the block hashes routed to one replica: a guess of what its cache holds."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def overlap(self, hashes: Sequence[int]) -> int:
        """Number of leading `hashes` recorded (hashes are chained: a gap ends the prefix)."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class KvAwarePolicy(RoutingPolicy):
    """Dynamo-style cost routing over reported loads; see the module docstring."""

    def __init__(self, inputs: RoutingInputs) -> None:
        super().__init__(inputs)
        keys = [(DECODE, i) for i in range(inputs.num_decode)]
        keys += [(PREFILL, i) for i in range(inputs.num_prefill)]
        self._used = {k: 0 for k in keys}          # blocks in use at the last report
        self._routed = {k: 0 for k in keys}        # blocks routed there since that report
        self._records = {k: PrefixRecord(DEFAULT_RECORD_BLOCKS) for k in keys}

    def observe(self, loads: Sequence[ReplicaLoad]) -> None:
        for load in loads:
            key = (load.role, load.replica_id)
            if key not in self._used:
                continue
            self._used[key] = load.kv_blocks_used
            self._routed[key] = 0
            if load.kv_blocks_total:
                self._records[key].capacity = load.kv_blocks_total

    def route(self, prompt_ids: Sequence[int]) -> Route:
        bs = self.inputs.block_size
        # The last prompt token is always computed (a hit never covers it), as in the engine.
        hashes = prefix_block_hashes(prompt_ids[:-1], bs)
        num_blocks = -(-len(prompt_ids) // bs)
        decode_id, overlap = self._cheapest(DECODE, self.inputs.num_decode, hashes, num_blocks)
        self._assign((DECODE, decode_id), hashes, num_blocks)
        uncached = len(prompt_ids) - overlap * bs
        if not self.inputs.num_prefill or uncached < self.inputs.conditional_disagg_threshold:
            return Route(decode_id)
        prefill_id, _ = self._cheapest(PREFILL, self.inputs.num_prefill, hashes, num_blocks)
        self._assign((PREFILL, prefill_id), hashes, num_blocks)
        return Route(decode_id, prefill_id)

    def cost(self, role: str, replica_id: int, hashes: Sequence[int],
             num_blocks: int) -> tuple[float, int]:
        """(cost, prefix blocks held) of sending a prompt of `num_blocks` blocks there."""
        key = (role, replica_id)
        overlap = self._records[key].overlap(hashes)
        active = self._used[key] + self._routed[key]
        return self.inputs.prefill_weight * (num_blocks - overlap) + active, overlap

    def _cheapest(self, role: str, count: int, hashes: Sequence[int],
                  num_blocks: int) -> tuple[int, int]:
        costs = [self.cost(role, i, hashes, num_blocks) for i in range(count)]
        best = min(range(count), key=lambda i: costs[i][0])   # ties: the lowest id
        return best, costs[best][1]

    def _assign(self, key: tuple[str, int], hashes: Sequence[int], num_blocks: int) -> None:
        self._routed[key] += num_blocks
        self._records[key].add(hashes)


POLICIES: dict[str, type[RoutingPolicy]] = {"kv_aware": KvAwarePolicy,
                                            "round_robin": RoundRobinPolicy}


def make_policy(name: str, inputs: RoutingInputs) -> RoutingPolicy:
    """The policy registered under `name` (router/app_config.py: ROUTING_POLICIES)."""
    if name not in POLICIES:
        raise ValueError(f"routing.policy: unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](inputs)
