"""The KV cache hierarchy's settings and its load-or-recompute rule (docs/kv_tiers.md). Engine
core: no Ray here; the tiers themselves are actors/kv_tier*.py.

    TierSettings    what router/app_sections.py KVTiersConfig says, as the engines get it
    LoadCost        whether loading a cached prefix from a tier beats computing it again:

        load  iff  tokens >= min_load_tokens
              and  overhead + host bytes / host bandwidth + disk bytes / disk bandwidth
                     <  tokens / prefill rate

    (a disk block counts in both: read from disk into host memory, then copied from there).
    Each tier's bandwidth starts at its configured guess and then follows the copies measured
    (an exponential average of bytes / seconds of the copy alone: host memory → the engine's
    cache; disk → host memory), and the overhead (round trips to the host tier, the engine
    thread's bookkeeping) starts at LOAD_OVERHEAD_S and follows what a load took beyond its
    copies; the prefill rate is the configured one, or else follows the engine's own prefill
    steps (tokens computed / step seconds). Short prefixes lose: the overhead costs more
    than the few tokens' compute.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

# Weight of a new measurement in the running averages: recent enough to follow a change of
# load, smooth enough that one slow outlier does not flip the rule.
EWMA_WEIGHT = 0.2
# Fixed cost of any load (actor round trips, a lookup), seconds: what makes a few tokens
# cheaper to recompute however fast the copy.
LOAD_OVERHEAD_S = 2e-3
# The prefill rate assumed before a prefill step was measured (tokens/s), deliberately low
# (a CPU's): a fresh engine loads rather than recomputes until it knows better.
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0


class Tier(str, enum.Enum):
    GPU = "gpu"      # the engine's own KV cache (never loaded: a prefix-cache hit)
    HOST = "host"    # the node's host-memory tier (a DistributedKVCache in shared memory)
    DISK = "disk"    # the node's disk tier, under the host tier


@dataclasses.dataclass(frozen=True, slots=True)
class TierSettings:
    """KVTiersConfig's fields as engines and tier pools use them."""

    host_bytes: int = 4 * 2**30
    disk_path: str | None = None
    disk_bytes: int = 64 * 2**30
    host_gbps: float = 8.0
    disk_gbps: float = 1.0
    prefill_tokens_per_s: float | None = None
    min_load_tokens: int = 0

    @classmethod
    def of(cls, config: Any) -> TierSettings:
        """From a KVTiersConfig, or a mapping of its fields (extra ones, like `enabled`,
        ignored)."""
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
        return cls(**{f.name: get(f.name) for f in dataclasses.fields(cls)})

    def host_blocks(self, block_bytes: int) -> int:
        if self.host_bytes < block_bytes:
            raise ValueError(f"kv_tiers.host_bytes: {self.host_bytes} is below one KV block "
                             f"({block_bytes} bytes)")
        return self.host_bytes // block_bytes


class LoadCost:
    """The load-or-recompute rule (module docstring), with its measured rates. One per
    engine, touched by the actor's event loop (measurements) and read there."""

    def __init__(self, settings: TierSettings) -> None:
        self.settings = settings
        self.gbps = {Tier.HOST: settings.host_gbps, Tier.DISK: settings.disk_gbps}
        self.prefill_tps = settings.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
        self.overhead_s = LOAD_OVERHEAD_S
        self._measured_prefill = False

    def saving(self, tokens: int, nbytes: Mapping[Tier, int]) -> float:
        """Seconds saved by loading `tokens` tokens' blocks (`nbytes` of them from each tier)
        instead of computing them; <= 0: recompute (so too below min_load_tokens)."""
        if tokens <= 0 or tokens < self.settings.min_load_tokens:
            return 0.0
        load_s = self.overhead_s + sum(n / (self.gbps[t] * 1e9) for t, n in nbytes.items())
        return tokens / self.prefill_tps - load_s

    def loaded(self, tier: Tier, nbytes: int, seconds: float) -> None:
        """A copy of `nbytes` out of `tier` took `seconds` (the copy alone)."""
        if nbytes > 0 and seconds > 0:
            self.gbps[tier] += EWMA_WEIGHT * (nbytes / seconds / 1e9 - self.gbps[tier])

    def overhead(self, seconds: float) -> None:
        """A load took `seconds` beyond its copies."""
        if seconds >= 0:
            self.overhead_s += EWMA_WEIGHT * (seconds - self.overhead_s)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """The engine computed `tokens` prompt tokens in `seconds` (one step); ignored when
        the rate is configured."""
        if self.settings.prefill_tokens_per_s is not None or tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        if not self._measured_prefill:
            self.prefill_tps, self._measured_prefill = rate, True
        else:
            self.prefill_tps += EWMA_WEIGHT * (rate - self.prefill_tps)
