"""`pd-cluster bench`: a streaming load generator for any OpenAI-compatible endpoint."""
