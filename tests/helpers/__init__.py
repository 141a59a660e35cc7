"""Helpers the tests share: waiting, free ports and reference logprobs (common.py), synthetic episodes,
the replay staleness simulation, Hypothesis strategies for every record, and the weight-sync tests' tiny
model, rollout actors and learner weight server."""
