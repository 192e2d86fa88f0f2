"""Owns the model, the KV cache and the sampler; launches one scheduled step.

Per step: flatten the scheduled tokens, build the attention metadata (positions, slot mapping,
block tables, lengths), run the model, take the hidden state of each sequence that samples,
compute its logits and sample. Nothing here waits for the device: host inputs go up with
non-blocking copies, and the sampled tokens come back in a `LaunchedStep` that is read later,
so the engine can plan and launch the next step while this one runs (async scheduling). A
decode whose input token is still on the device (PENDING_TOKEN) takes it from the previous
step's sampled tokens, on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pd_cluster.attention.base import AttentionBackend, AttentionMetadata
from pd_cluster.attention.torch_backend import TorchAttentionBackend
from pd_cluster.config import EngineConfig, ModelConfig
from pd_cluster.cuda_graphs import DecodeGraphs
from pd_cluster.forward_context import ForwardContext
from pd_cluster.kv_layout import KVLayout
from pd_cluster.models import ops
from pd_cluster.models.loader import load_model
from pd_cluster.request import PENDING_TOKEN, Request
from pd_cluster.sampler import Sampler, Samples
from pd_cluster.scheduler import SchedulerOutput
from pd_cluster.upload import upload_many

SampledTokens = dict[str, tuple[int, dict[int, float] | None]]


@dataclass(slots=True)
class LaunchedStep:
    """A step in flight: its plan, the requests that sample (in row order) and their samples."""

    plan: SchedulerOutput
    sampling: list[Request]
    rows: dict[str, int]                  # request id -> row in `samples`
    samples: Samples | None               # on the device (None: nobody samples)
    host: Samples | None                  # the copy on its way to the host
    done: torch.cuda.Event | None         # fires when `host` is readable (None on CPU)

    def result(self) -> SampledTokens:
        """Wait for the step and return each sampling request's (token, logprobs)."""
        if self.host is None:
            return {}
        if self.done is not None:
            self.done.synchronize()
        return {r.request_id: res for r, res in zip(self.sampling, self.host.results(self.sampling))}


class StepListener(Protocol):
    """Watches a step's forward pass (the prefill side pushes KV from these hooks)."""

    def before_forward(self, plan: SchedulerOutput) -> None: ...

    def after_layer(self, layer_idx: int) -> None:
        """Layer `layer_idx` has been issued; its KV writes are queued on the device."""


def select_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    name = config.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    try:
        from pd_cluster.attention.triton_backend import TritonAttentionBackend
    except ImportError as e:
        raise ImportError(f"attention_backend='triton' needs Triton: pip install triton ({e})")
    return TritonAttentionBackend()


# GPU memory an engine holds outside torch's allocator (CUDA context, kernel images, library
# handles): counted against its gpu_memory_utilization share.
NON_TORCH_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str | None, model_cfg: ModelConfig,
                 max_model_len: int, model_name: str):
        self.config, self.model_cfg = config, model_cfg
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(model_cfg)
        self.block_size = config.block_size
        self.backend = select_backend(config, self.device)
        ops.use_triton(self.backend.name == "triton")
        if self.backend.name == "triton":
            from kernels import compiles
            compiles.watch()
        # What this process's allocator holds before the engine loads anything (another
        # engine's, in tests): not this engine's to count against gpu_memory_utilization.
        self._torch_base = torch.cuda.memory_reserved(self.device) \
            if self.device.type == "cuda" else 0
        self.model = load_model(model_dir, model_cfg, max_model_len, self.dtype, self.device,
                                config.load_format, config.seed)
        self.kv_layout = KVLayout(model=model_name, dtype=str(self.dtype).removeprefix("torch."),
                                  num_layers=model_cfg.num_layers,
                                  num_blocks=self._num_blocks(max_model_len),
                                  block_size=self.block_size, num_kv_heads=model_cfg.num_kv_heads,
                                  head_dim=model_cfg.head_dim)
        self.kv_cache = self.kv_layout.allocate(self.device)
        self.sampler = Sampler(self.device)
        self.graphs = None
        if config.cuda_graphs and self.device.type == "cuda" and self.backend.name == "triton":
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.backend,
                                       min(config.max_num_seqs, 512), max_model_len,
                                       self.block_size, model_cfg.hidden_size)

    def _num_blocks(self, max_model_len: int) -> int:
        c, m = self.config, self.model_cfg
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        bytes_per_block = (2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim
                           * self.dtype.itemsize)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations of a full token budget (logits dominate at large vocab).
            reserve = c.max_num_batched_tokens * (8 * m.hidden_size + 2 * m.intermediate_size) * 4
            # Our share of the GPU less what we hold (vLLM's meaning): what our allocator took
            # since we started, plus the CUDA context and libraries' own memory. Not the
            # device's used memory: an engine starting beside us on the GPU would count as
            # ours, and whichever sized its KV second got next to nothing. Never more than free.
            mine = torch.cuda.memory_reserved(self.device) - self._torch_base + NON_TORCH_BYTES
            budget = min(total * c.gpu_memory_utilization - mine, free) - reserve
        else:
            budget = c.kv_cache_memory_gb * 2**30
        # No point in more blocks than max_num_seqs full-length sequences can use.
        cap = c.max_num_seqs * -(-max_model_len // self.block_size) + 1
        n = min(int(budget // bytes_per_block), cap)
        if n < 2:
            raise ValueError(f"not enough memory for the KV cache ({budget / 2**30:.2f} GiB left)")
        return n

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, listener: StepListener | None = None,
                prev: LaunchedStep | None = None) -> LaunchedStep:
        """Launch `plan`; `prev` is the step still in flight, whose tokens feed this one."""
        input_ids, positions, meta, sample_idx = self._prepare(plan, prev)
        if listener is not None:
            listener.before_forward(plan)
        if self._graph_ok(meta, listener):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            ctx = ForwardContext(meta, self.kv_cache, self.backend,
                                 listener.after_layer if listener else None)
            hidden = self.model(input_ids, positions, ctx)
        sampling = [s.request for s in plan.scheduled if s.samples]
        if not sampling:
            return LaunchedStep(plan, [], {}, None, None, None)
        samples = self.sampler(self.model.compute_logits(hidden[sample_idx]), sampling)
        host = samples.to_host()
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        rows = {r.request_id: i for i, r in enumerate(sampling)}
        return LaunchedStep(plan, sampling, rows, samples, host, done)

    def _graph_ok(self, meta: AttentionMetadata, listener: StepListener | None) -> bool:
        # Graphs replay whole forwards: no per-layer hooks, decode-only batches that fit.
        return (self.graphs is not None and listener is None
                and meta.num_decodes == meta.num_seqs and self.graphs.can_run(meta.num_seqs))

    def _prepare(self, plan: SchedulerOutput, prev: LaunchedStep | None):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_start, seq_lens, sample_idx = [0], [], []
        fill_at, fill_from = [], []   # input positions whose token is still on the device
        max_blocks = max(len(s.request.block_ids) for s in plan.scheduled)
        tables = np.zeros((len(plan.scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(plan.scheduled):
            req, start = s.request, s.request.num_computed_tokens
            end, blocks = start + s.num_tokens, req.block_ids
            ids.extend(req.token_slice(start, end))
            pos.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            tables[i, :len(blocks)] = blocks
            q_start.append(q_start[-1] + s.num_tokens)
            seq_lens.append(end)
            if s.samples:
                sample_idx.append(q_start[-1] - 1)
                if ids[-1] == PENDING_TOKEN:
                    fill_at.append(len(ids) - 1)
                    fill_from.append(prev.rows[req.request_id])
        num_decodes = 0
        while num_decodes < len(plan.scheduled) and plan.scheduled[num_decodes].num_tokens == 1:
            num_decodes += 1
        i64 = [np.asarray(v, dtype=np.int64) for v in (ids, pos, slots, sample_idx, fill_at,
                                                        fill_from)]
        i32 = [np.asarray(v, dtype=np.int32) for v in (q_start, seq_lens)]
        (input_ids, positions, slot_mapping, sample_rows, fill_at_d, fill_from_d,
         query_start_loc, seq_lens_d, block_tables) = upload_many(i64 + i32 + [tables],
                                                                  self.device)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens_d,
            block_tables=block_tables, num_decodes=num_decodes, num_decode_tokens=num_decodes,
            max_query_len=max(s.num_tokens for s in plan.scheduled), max_seq_len=max(seq_lens),
            query_start_loc_cpu=q_start, seq_lens_cpu=seq_lens)
        if fill_at:
            input_ids[fill_at_d] = prev.samples.tokens[fill_from_d]
        return input_ids, positions, meta, sample_rows
