"""Owns the model, the KV cache and the sampler; launches one scheduled step.

Per step: flatten the scheduled tokens, build the attention metadata (positions, slot mapping,
block tables, lengths), run the model, take the hidden state of each sequence that samples,
compute its logits and sample. Nothing here waits for the device: host inputs go up with
non-blocking copies, and the sampled tokens come back in a `LaunchedStep` that is read later,
so the engine can plan and launch the next step while this one runs (async scheduling). A
decode whose input token is still on the device (PENDING_TOKEN) takes it from the previous
step's sampled tokens, on the device.

With `tensor_parallel_size` N > 1 this runner is rank 0 of N: it starts ranks 1..N-1
(pd_cluster/tp_workers.py), whose runners `follow` it: it writes each step's host inputs
(StepInputs) into a shared-memory ring (pd_cluster/step_channel.py) without waiting for the
others, every rank runs the forward pass on its shard (a CUDA graph for decode steps, the
all-reduces inside it) and computes the sampling rows' logits, rank 0 samples and broadcasts
the tokens on the device. Each rank's KV cache holds its own KV heads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from kernels.fp8_math import FP8
from pd_cluster.attention.base import AttentionBackend, AttentionMetadata
from pd_cluster.attention.torch_backend import TorchAttentionBackend
from pd_cluster import distributed as dist
from pd_cluster import kv_sizing
from pd_cluster.config import EngineConfig, ModelConfig
from pd_cluster.cuda_graphs import DecodeGraphs
from pd_cluster.forward_context import ForwardContext
from pd_cluster.kv_layout import KVLayout
from pd_cluster.kv_scales import ScaledKVBackend, calibrate, kv_scales_for
from pd_cluster.models import ops
from pd_cluster.models.loader import load_model
from pd_cluster.request import PENDING_TOKEN, Request
from pd_cluster.sampler import Sampler, Samples
from pd_cluster.scheduler import SchedulerOutput
from pd_cluster.spec_decode.verify import SpecRow, verify
from pd_cluster.step_channel import StepChannel, StepInputs
from pd_cluster.structured.constraint import GrammarConstraint
from pd_cluster.tp_workers import RankWorkers, backend_for
from pd_cluster.upload import upload, upload_many

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
    # Speculating requests (not in `sampling`): the tokens verification emitted, known on the
    # host already (a speculative step is never left in flight).
    emitted: dict[str, list[int]] = field(default_factory=dict)

    def result(self) -> SampledTokens:
        """Wait for the step and return each sampling request's (token, logprobs); a
        speculating request's first token (the rest: `emitted`)."""
        firsts = {rid: (tokens[0], None) for rid, tokens in self.emitted.items()}
        if self.host is None:
            return firsts
        if self.done is not None:
            self.done.synchronize()
        return {r.request_id: res for r, res in zip(self.sampling, self.host.results(self.sampling))
                } | firsts


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


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str | None, model_cfg: ModelConfig,
                 max_model_len: int, model_name: str, rank: int = 0):
        self.config, self.model_cfg, self.rank = config, model_cfg, rank
        self.tp_size = config.tensor_parallel_size
        self.workers: Any = None
        self.device = config.torch_device(rank)
        if self.device.index is not None:     # a rank's own GPU: its kernels' default
            torch.cuda.set_device(self.device)
        self.channel: StepChannel | None = None      # rank 0 of N: the followers' inputs
        if self.tp_size > 1 and rank == 0:
            self._start_ranks((config, model_dir, model_cfg, max_model_len, model_name))
        if self.tp_size > 1 and self.device.type == "cuda":
            dist.enable_peer_all_reduce([config.torch_device(r) for r in range(self.tp_size)],
                                        config.peer_all_reduce)
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
                                config.load_format, config.seed, config.quantization,
                                config.enable_expert_parallel)
        self.num_kv_heads = dist.kv_head_shard(model_cfg.num_kv_heads, self.tp_size, rank)[0]
        # KV cache dtype: the model's, or fp8 with per-layer scales (pd_cluster/kv_scales.py).
        self.kv_dtype, self.kv_scales = self.dtype, ()
        if config.kv_cache_dtype == "fp8":
            if model_cfg.mla is not None:
                raise ValueError(f"kv_cache_dtype fp8 is not supported for {model_cfg.architecture}"
                                 f" (its latent KV cache stays in the model dtype)")
            self.kv_dtype = FP8
            self.kv_scales = kv_scales_for(self.model, lambda: self._calibrate(max_model_len),
                                           model_cfg.num_layers)
        blocks = kv_sizing.num_blocks(config, model_cfg, self.num_kv_heads, self.kv_dtype,
                                      self.device, self._torch_base, max_model_len)
        self.kv_layout = self._rank_layout(rank, model_name, kv_sizing.agreed(blocks, self.tp_size))
        self.kv_cache = self.kv_layout.allocate(self.device)
        if self.tp_size > 1 and self.device.type == "cpu":
            self.kv_cache.share_memory_()       # rank 0's transport maps every rank's KV
        # fp8: [num_layers, 2] float32 (K, V) on the device; the backend hands each layer its
        # row (a fixed address that CUDA graphs capture).
        self.kv_scale_tensor: torch.Tensor | None = None
        if self.kv_scales:
            self.kv_scale_tensor = torch.tensor(self.kv_scales, dtype=torch.float32,
                                                device=self.device)
            self.backend = ScaledKVBackend(self.backend, self.kv_cache, self.kv_scale_tensor)
        self._kv_shards: list[tuple[torch.Tensor, KVLayout]] | None = None
        self.sampler = Sampler(self.device)
        self.grammar: GrammarConstraint | None = None    # set by an engine with a tokenizer
        self._last_tokens: torch.Tensor | None = None    # a follower's copy of the samples
        self.graphs = None
        max_batch = self._graph_batch_limit(min(config.max_num_seqs, 512))
        if (config.cuda_graphs and self.device.type == "cuda" and self.backend.name == "triton"
                and max_batch > 0):
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.backend, max_batch,
                                       max_model_len, self.block_size, model_cfg.hidden_size,
                                       self.dtype)

    def _graph_batch_limit(self, wanted: int) -> int:
        """The largest batch decode graphs are captured for. With tensor parallelism every
        rank captures the same sizes with the all-reduces inside, and only the peer
        all-reduce's: bench/tp_bench.py on an 8B engine at tp=2 whose graphs held NCCL's
        (through torch.distributed) did not finish in 80 s on two H200s, where the same run
        with the peer all-reduce takes about 45 s (not looked into further). So without peer
        memory, and for batches whose [batch, hidden] message is larger than it takes, decode
        runs eagerly."""
        peer = dist.get_tp().peer
        if self.tp_size == 1:
            return wanted
        if peer is None:
            return 0
        row_bytes = self.model_cfg.hidden_size * self.dtype.itemsize
        return min(wanted, peer.max_bytes // row_bytes)

    def _rank_layout(self, rank: int, model_name: str, num_blocks: int) -> KVLayout:
        """The KV layout of `rank`'s cache: its window of the model's KV heads."""
        m = self.model_cfg
        local, first = dist.kv_head_shard(m.num_kv_heads, self.tp_size, rank)
        window = {} if self.tp_size == 1 else {"head_start": first,
                                               "total_kv_heads": m.num_kv_heads}
        return KVLayout(model=model_name, dtype=str(self.kv_dtype).removeprefix("torch."),
                        num_layers=m.num_layers, num_blocks=num_blocks,
                        block_size=self.block_size, num_kv_heads=local, head_dim=m.head_dim,
                        kv_scales=self.kv_scales, latent=m.mla is not None, **window)

    def _calibrate(self, max_model_len: int):
        """Calibrated fp8 KV scales (pd_cluster/kv_scales.py), its memory given back after."""
        m = self.model_cfg
        scales = calibrate(self.model, m.vocab_size, m.num_layers, self.num_kv_heads,
                           m.head_dim, self.dtype, self.device, max_model_len,
                           self.block_size)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()    # the throwaway cache and activations: not ours to keep
        return scales

    def kv_shards(self) -> list[tuple[torch.Tensor, KVLayout]]:
        """Rank 0: every rank's KV cache and its layout, in rank order (one with one rank):
        what the engine's transport registers."""
        if self._kv_shards is None:
            shards = [(self.kv_cache, self.kv_layout)]
            if self.workers is not None:
                caches = self.workers.kv_caches()
                shards += [(caches[r], self._rank_layout(r, self.kv_layout.model,
                                                         self.kv_layout.num_blocks))
                           for r in range(1, self.tp_size)]
            self._kv_shards = shards
        return self._kv_shards

    def _start_ranks(self, runner_args: tuple) -> None:
        """Rank 0: start ranks 1..N-1, each building a ModelRunner of its own, and join their
        group (pd_cluster/tp_workers.py)."""
        dist.check_tp(self.model_cfg, self.tp_size, self.config.enable_expert_parallel)
        dist.check_no_group()
        self.channel = StepChannel.create(self.tp_size - 1)
        self.workers = RankWorkers(self.tp_size, ModelRunner, runner_args, self.channel.file.path)
        self.workers.start()
        try:
            dist.init_tp(0, self.tp_size, self.workers.init_method,
                         backend_for(self.device.type), self.workers.timeout_s)
        except BaseException:
            self.workers.close()
            self.channel.close()
            raise
        self.channel.unlink()       # every rank has it mapped: no name to leak from here on

    def close(self) -> None:
        """Rank 0 of a tensor-parallel engine: stop the other ranks, leave the group."""
        if self.workers is None:
            return
        workers, self.workers = self.workers, None
        try:
            if not workers.dead():
                self.channel.send(None, workers.timeout_s)
        except Exception:  # noqa: BLE001 - a rank is gone: reap what is left
            pass
        workers.close()
        self.channel.close()
        dist.destroy_tp()

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, listener: StepListener | None = None,
                prev: LaunchedStep | None = None,
                draft_probs: dict[str, torch.Tensor] | None = None) -> LaunchedStep:
        """Launch `plan`; `prev` is the step still in flight, whose tokens feed this one.
        A plan with drafts is verified here, synchronously (`draft_probs`: a sampling draft
        model's q per request id)."""
        inputs = self._host_inputs(plan, prev)
        inputs.use_graph = self._graph_ok(inputs, listener)
        if self.channel is not None:
            self.channel.send(inputs, self.workers.timeout_s)
        if listener is not None:
            listener.before_forward(plan)
        logits = self._forward(inputs, prev.samples.tokens if inputs.fill_at.size else None,
                               listener)
        emitted = {}
        if any(s.draft for s in plan.scheduled):
            logits, emitted = self._verify(plan, logits, draft_probs or {})
        sampling = [s.request for s in plan.scheduled if s.samples and not s.draft]
        if not sampling:
            return LaunchedStep(plan, [], {}, None, None, None, emitted)
        if self.grammar is not None:    # masks computed while the forward pass runs
            self.grammar.apply(logits, sampling, prev)
        samples = self.sampler(logits, sampling)
        if self.tp_size > 1:
            dist.broadcast_tensor(samples.tokens)    # the followers' next input tokens
        host = samples.to_host()
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        rows = {r.request_id: i for i, r in enumerate(sampling)}
        return LaunchedStep(plan, sampling, rows, samples, host, done, emitted)

    def _verify(self, plan: SchedulerOutput, logits: torch.Tensor,
                draft_probs: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, list[int]]]:
        """Split the logits into the plain sampling rows (returned) and the speculating
        sequences' k + 1 rows each, which are verified (pd_cluster/spec_decode/verify.py)."""
        plain, spec, specs, at = [], [], [], 0
        for s in plan.scheduled:
            if not s.samples:
                continue
            width = 1 + len(s.draft)
            (spec if s.draft else plain).extend(range(at, at + width))
            if s.draft:
                specs.append(SpecRow(s.request, s.draft, draft_probs.get(s.request.request_id)))
            at += width
        # Only verifications (the batch-1 case): no gathers, no index uploads.
        spec_logits = logits if not plain else logits[upload(spec, torch.long, logits.device)]
        tokens = verify(spec_logits, specs, self.sampler)
        emitted = {row.request.request_id: t for row, t in zip(specs, tokens)}
        return logits[upload(plain, torch.long, logits.device)] if plain else None, emitted

    @torch.inference_mode()
    def logits(self, plan: SchedulerOutput) -> torch.Tensor | None:
        """One forward of `plan` (no draft rows, no token on the device), returning the
        logits of its sampling rows: the draft model's step (pd_cluster/spec_decode/draft.py)."""
        inputs = self._host_inputs(plan, None)
        inputs.use_graph = self._graph_ok(inputs, None)
        return self._forward(inputs, None, None)

    @torch.inference_mode()
    def follow(self, channel: StepChannel) -> None:
        """Ranks 1..N-1: run every step rank 0 writes to `channel`, until it writes None."""
        while (inputs := channel.receive(self.rank - 1)) is not None:
            self._forward(inputs, self._last_tokens if inputs.fill_at.size else None, None)
            if inputs.sample_idx.size:
                tokens = torch.empty(inputs.sample_idx.size, dtype=torch.int64,
                                     device=self.device)
                self._last_tokens = dist.broadcast_tensor(tokens)

    def _forward(self, inputs: StepInputs, last_tokens: torch.Tensor | None,
                 listener: StepListener | None) -> torch.Tensor | None:
        """The forward pass of one step: the logits of its sampling rows (None: no row
        samples). `last_tokens`: the samples of the step before, for PENDING_TOKEN inputs."""
        input_ids, positions, meta, sample_idx = self._upload(inputs, last_tokens)
        if inputs.use_graph:
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            ctx = ForwardContext(meta, self.kv_cache, self.backend,
                                 listener.after_layer if listener else None)
            hidden = self.model(input_ids, positions, ctx)
        if not inputs.sample_idx.size:
            return None
        return self.model.compute_logits(hidden[sample_idx])

    def _graph_ok(self, inputs: StepInputs, listener: StepListener | None) -> bool:
        # Graphs replay whole forwards: no per-layer hooks, decode-only batches that fit.
        batch = len(inputs.seq_lens)
        return (self.graphs is not None and listener is None
                and inputs.num_decodes == batch and self.graphs.can_run(batch))

    def _host_inputs(self, plan: SchedulerOutput, prev: LaunchedStep | None) -> StepInputs:
        """The step's flattened inputs. A speculating request's k + 1 tokens (its last token
        and drafts, pd_cluster/spec_decode/) become k + 1 one-token sequences over the same
        blocks, the i-th attending to the context up to its own position: every layer
        stores all new K/V before it attends, so each sees the drafts before it. A step of
        decodes and verifications is then decode-only (decode kernel, CUDA graphs)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_start, seq_lens, sample_idx = [0], [], []
        fill_at, fill_from = [], []   # input positions whose token is still on the device
        rows = [s.request.block_ids for s in plan.scheduled for _ in range(1 + len(s.draft))]
        tables = np.zeros((len(rows), max(len(b) for b in rows)), dtype=np.int32)
        for i, blocks in enumerate(rows):
            tables[i, :len(blocks)] = blocks
        for s in plan.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            end, blocks = start + s.num_tokens, req.block_ids
            ids.extend(req.token_slice(start, end - len(s.draft)) + s.draft)
            pos.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if s.draft:
                q_start.extend(range(q_start[-1] + 1, q_start[-1] + s.num_tokens + 1))
                seq_lens.extend(range(start + 1, end + 1))
            else:
                q_start.append(q_start[-1] + s.num_tokens)
                seq_lens.append(end)
            if s.samples:
                sample_idx.extend(range(q_start[-1] - 1 - len(s.draft), q_start[-1]))
                if ids[-1 - len(s.draft)] == PENDING_TOKEN:
                    fill_at.append(len(ids) - 1 - len(s.draft))
                    fill_from.append(prev.rows[req.request_id])
        q_lens = np.diff(q_start)
        num_decodes = int(np.argmin(q_lens == 1)) if (q_lens != 1).any() else len(q_lens)
        i64 = [np.asarray(v, dtype=np.int64) for v in (ids, pos, slots, sample_idx, fill_at,
                                                        fill_from)]
        return StepInputs(*i64, q_start, seq_lens, tables, num_decodes, int(q_lens.max()))

    def _upload(self, inputs: StepInputs, last_tokens: torch.Tensor | None):
        x = inputs
        i32 = [np.asarray(v, dtype=np.int32) for v in (x.q_start, x.seq_lens)]
        (input_ids, positions, slot_mapping, sample_rows, fill_at_d, fill_from_d,
         query_start_loc, seq_lens_d, block_tables) = upload_many(
            [x.ids, x.pos, x.slots, x.sample_idx, x.fill_at, x.fill_from] + i32 + [x.tables],
            self.device)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens_d,
            block_tables=block_tables, num_decodes=x.num_decodes,
            num_decode_tokens=x.num_decodes, max_query_len=x.max_query_len,
            max_seq_len=max(x.seq_lens), query_start_loc_cpu=x.q_start,
            seq_lens_cpu=x.seq_lens)
        if x.fill_at.size:
            input_ids[fill_at_d] = last_tokens[fill_from_d]
        return input_ids, positions, meta, sample_rows
