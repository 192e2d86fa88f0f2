"""`speculative:` of an engine's config: which proposer, how many tokens, when to fall back.

Imports pydantic only (EngineConfig embeds it, and the router validates configs without torch).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# As config.STRICT_MODEL_CONFIG (not imported: config.py imports this module).
_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class SpeculativeConfig(BaseModel):
    """Speculative decoding on the engine that decodes (D, or a colocated engine).

    Each step, every eligible running sequence gets up to `num_speculative_tokens` proposed
    tokens, and one target forward over [last token, proposals] verifies them all.
    """

    model_config = _STRICT

    method: Literal["ngram", "draft_model"] = Field("ngram", description=(
        "ngram: prompt lookup (the continuation of the latest earlier match of the last n "
        "tokens in prompt + output); draft_model: a smaller model with the same vocabulary"))
    num_speculative_tokens: int = Field(4, ge=1, le=16, description=(
        "tokens proposed per sequence and step (k): one verification forward covers k + 1"))
    prompt_lookup_min: int = Field(2, ge=1, description="ngram: shortest n-gram matched")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: longest n-gram matched (tried first)")
    draft_model: str | None = Field(None, min_length=1, description=(
        "draft_model: its checkpoint directory (same tokenizer and vocabulary as the target)"))
    draft_load_format: Literal["auto", "dummy"] = Field("auto", description=(
        "draft_model: auto (safetensors) or dummy (random weights; tests and benchmarks)"))
    draft_num_kv_blocks: int | None = Field(None, ge=1, description=(
        "draft_model: KV blocks of the draft's own paged cache; null: the target's count"))
    max_batch_size: int = Field(16, ge=1, description=(
        "speculate only while at most this many sequences run: in a bigger batch the step "
        "is compute-bound and verifying k extra tokens costs more than it saves"))
    min_acceptance_rate: float = Field(0.2, ge=0, le=1, description=(
        "a sequence whose acceptance-rate EWMA falls below this stops speculating"))
    acceptance_ewma: float = Field(0.3, gt=0, le=1, description=(
        "weight of the newest step in a sequence's acceptance-rate EWMA"))
    min_steps_before_fallback: int = Field(4, ge=1, description=(
        "verification steps a sequence gets before its EWMA may stop it"))

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError("method draft_model needs draft_model, the draft's checkpoint "
                             "directory")
        return self
