"""Speculative decoding: proposals (n-gram prompt lookup or a draft model), verification in
one target forward, fallbacks and counters. README.md, "Speculative decoding", says how."""
