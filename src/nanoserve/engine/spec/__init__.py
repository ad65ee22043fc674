"""Speculative decoding's proposers: n-gram prompt lookup and a draft model, and the counters of
drafts made and kept. The engine verifies their drafts in its step."""
