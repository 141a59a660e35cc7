"""Helpers the tests share: synthetic episodes, the replay staleness simulation, and the weight-sync
tests' tiny model, rollout actors and learner weight server."""
