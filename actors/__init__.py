"""Kiln's actors: rollout, verifier, replay (buffer) and learner. See actors/base.py for the lifecycle."""
