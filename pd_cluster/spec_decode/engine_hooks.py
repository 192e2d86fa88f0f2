"""Building an engine's SpecDecoder from its config (the draft model's engine parts too).

It takes the values it needs, not the engine: the engine imports this module, so this one
importing the engine would make the two depend on each other."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pd_cluster.spec_decode.decoder import SpecDecoder

if TYPE_CHECKING:
    from pd_cluster.config import EngineConfig


def build_spec_decoder(config: EngineConfig, max_model_len: int, vocab_size: int) -> SpecDecoder:
    """The SpecDecoder for `config.speculative` on an engine serving up to `max_model_len`
    tokens of a model with `vocab_size` ids (a draft model must share that vocabulary)."""
    spec = config.speculative
    if config.tensor_parallel_size > 1:
        raise ValueError("speculative: not supported with tensor_parallel_size > 1 yet "
                         "(the other ranks sample one row per sequence)")
    draft = None
    if spec.method == "draft_model":
        from pd_cluster.spec_decode.draft import DraftProposer
        draft = DraftProposer(config, max_model_len, vocab_size)
    return SpecDecoder(spec, draft)
