"""Weight transport from the learner to the engines."""
