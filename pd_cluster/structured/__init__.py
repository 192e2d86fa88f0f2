"""Grammar-constrained decoding: JSON schema, any JSON object, regex and choice outputs.

A request's grammar travels with it as a `GrammarSpec` (inside its SamplingParams), so every
engine that samples for it (the prefill engine's first token, the decode engine after it, a
decode engine it migrates to) builds its own matcher from the spec and replays the tokens the
request already has: no matcher state crosses the wire. Each step, the engine computes the
token masks of the batch's constrained rows on the host while the forward pass runs on the
device, then applies them to the logits in one batched masked fill before sampling
(`GrammarConstraint`).

Engine: llguidance. It is a Rust library with a small Python binding and no torch
dependency, so the engine core and the router (which validates grammars for its 400s) import
it cheaply; it computes a mask in tens of microseconds for a typical JSON schema without an
ahead-of-time compilation of the whole grammar against the vocabulary (xgrammar precompiles
per schema, which costs a request's TTFT on every new schema), computes a batch's masks on
its own thread pool with the GIL released, and vLLM ships it as its `guidance` backend.
xgrammar is as fast once compiled but pulls torch-version-specific kernels; outlines-core
builds a full regex automaton per schema (slow for large schemas).
"""
from pd_cluster.structured.spec import GrammarKind, GrammarSpec

__all__ = ["GrammarKind", "GrammarSpec"]
