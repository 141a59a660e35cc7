"""The policy code that rollout and learner share: the model, the tokenizer, the logprob convention,
the prompts, and the weight transports between the learner and the engines."""
