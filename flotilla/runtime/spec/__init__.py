"""Speculative decoding: a proposer drafts tokens, the target verifies them in one pass.

    config.py     SpeculativeConfig (`--speculative ngram | draft:PATH`, `--num-speculative-tokens`)
    proposer.py   the Proposer interface and a Proposal (draft tokens, optional distributions)
    ngram.py      prompt lookup: the continuation of the longest earlier match
    draft.py      a draft model with its own paged KV cache
    rejection.py  the verifier: exact match for greedy rows, rejection sampling for sampled rows
    decoder.py    the engine's side: per-sequence K, proposals, acceptance counters
    builder.py    a SpecDecoder from a config and the loaded target

Nothing is imported here: model_runner imports rejection.py, and draft.py imports model_runner.
"""
