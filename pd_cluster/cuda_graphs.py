"""CUDA graphs of decode-only forward passes, one per padded batch size and context cap.

A decode step of a big model launches a few hundred small kernels; replaying a captured graph
removes their launch cost. Inputs live in static buffers that every replay reads: the runner
copies the step's ids, positions, slots, lengths and block tables in, pads the batch up to the
nearest captured size (padding rows write no KV: slot -1) and replays.

Over an fp8 KV cache each batch size is captured twice when max_model_len exceeds
SHORT_CONTEXT: for steps whose contexts all fit SHORT_CONTEXT tokens, and for the rest. The
attention kernels choose their programs (split count, warps) at capture from the longest
context the graph may see, and one choice does not fit both: batches of 16-127 decode long
contexts up to 15 % faster with one-warp programs in several splits, and short ones up to 1.7x
slower (kernels/decode_attention.py `one_warp`). The second set costs start-up
time (an 8B engine on an H200: 27.5 s against 17), so 16-bit caches, whose launch does not
change, keep one.

With an fp8 KV cache the backend (pd_cluster/kv_scales.py ScaledKVBackend) passes each layer's
scales as a view of one device tensor that never changes after load: the graphs capture its
address, not values.
"""
from __future__ import annotations

import torch

from pd_cluster.attention.base import AttentionBackend, AttentionMetadata
from pd_cluster.forward_context import ForwardContext
from pd_cluster.models import ops


SHORT_CONTEXT = 1024


def context_caps(max_model_len: int, fp8_kv: bool) -> list[int]:
    """The longest context each batch size's graphs are captured for."""
    if not fp8_kv:
        return [max_model_len]
    return sorted({min(SHORT_CONTEXT, max_model_len), max_model_len})


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, backend: AttentionBackend,
                 max_batch: int, max_model_len: int, block_size: int, hidden_size: int,
                 dtype: torch.dtype | None = None):
        dev = kv_cache.device
        self.max_model_len = max_model_len
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(max_batch, -(-max_model_len // block_size), dtype=torch.int32,
                                  device=dev)
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        # The hidden states, in the model's dtype (an fp8 KV cache's dtype is not it).
        self.out = torch.zeros(max_batch, hidden_size, dtype=dtype or kv_cache.dtype, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.caps = context_caps(max_model_len, kv_cache.dtype == torch.float8_e4m3fn)
        mempool = None
        for bs in sorted(capture_sizes(max_batch), reverse=True):  # largest first: one memory pool
            for cap in self.caps:
                ctx = ForwardContext(self._meta(bs, cap), kv_cache, backend)
                with ops.choosing_gemm_kernels():   # warm-up: compile, pick each GEMM's kernel
                    self.out[:bs] = model(self.ids[:bs], self.positions[:bs], ctx)
                    model.compute_logits(self.out[:bs])  # the step's lm_head, outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, mempool):
                    self.out[:bs] = model(self.ids[:bs], self.positions[:bs], ctx)
                mempool = graph.pool()
                self.graphs[bs, cap] = graph
        torch.cuda.synchronize(dev)
        self.sizes = sorted({bs for bs, _ in self.graphs})

    def _meta(self, bs: int, cap: int) -> AttentionMetadata:
        # Kernels size their split-KV grid for the longest context the graph may see (`cap`);
        # each replay then uses as many splits as the real lengths need.
        return AttentionMetadata(
            slot_mapping=self.slots[:bs], query_start_loc=self.query_start[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.tables[:bs], num_decodes=bs,
            num_decode_tokens=bs, max_query_len=1, max_seq_len=cap,
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[cap] * bs)

    def can_run(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [batch, hidden] of a decode-only step."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.ids[:n] = input_ids
        self.positions[:n] = positions
        self.slots[:n] = meta.slot_mapping
        self.slots[n:bs] = -1
        self.seq_lens[:n] = meta.seq_lens
        self.seq_lens[n:bs] = 1
        width = meta.block_tables.shape[1]
        self.tables[:n, :width] = meta.block_tables
        longest = max(meta.seq_lens_cpu)
        self.graphs[bs, next(c for c in self.caps if c >= longest)].replay()
        return self.out[:n]
