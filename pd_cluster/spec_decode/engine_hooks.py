"""Building an engine's SpecDecoder from its config (the draft model's engine parts too)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pd_cluster.spec_decode.decoder import SpecDecoder

if TYPE_CHECKING:
    from pd_cluster.config import EngineConfig
    from pd_cluster.engine import LLMEngine


def build_spec_decoder(config: EngineConfig, engine: LLMEngine) -> SpecDecoder:
    spec = config.speculative
    if config.tensor_parallel_size > 1:
        raise ValueError("speculative: not supported with tensor_parallel_size > 1 yet "
                         "(the other ranks sample one row per sequence)")
    draft = None
    if spec.method == "draft_model":
        from pd_cluster.spec_decode.draft import DraftProposer
        draft = DraftProposer(config, engine.max_model_len, engine.model_cfg.vocab_size)
    return SpecDecoder(spec, draft)
