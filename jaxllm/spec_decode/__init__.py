"""Speculative decoding: proposals by prompt lookup (ngram.py, host-side) or from a draft model
(draft_model.py, a runner of its own), which requests get them and when speculation switches itself off
(speculator.py), and how a step's samples accept them (verify.py)."""
