"""Speculative decoding by prompt lookup: host-side proposals (ngram.py), which requests get them and when
speculation switches itself off (speculator.py), and how a step's samples accept them (verify.py)."""
