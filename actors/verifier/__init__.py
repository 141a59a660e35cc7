"""The staged kernel verifier and the reward-actor interface (DESIGN.md §4).

Where things are:
  actor.py       VerifierActor: the ROUTER service around any reward actor, with its guard
  interface.py   the reward-actor interface (`RewardActor`), loaded by `actors.base.load_plugin`
  verifier.py    KernelVerifier: extract -> static scan -> compile -> run/correctness -> performance
  extract.py     stage 1: code from model output
  legality.py    the legality policy and the static scan; gate.py is its runtime half (in the sandbox)
  build/         the compile subsystem (BuildService, prebuilt extensions)
  zygote.py, executor.py, sandbox.py, wire.py   forked, confined execution children and their channel
  reference.py, compare.py, runner.py, baselines.py, timing.py, lease.py   the trusted side
  reward.py      the MooreEval score and the feedback texts; verdicts.py: the verdict cache
  examples.py    TextMatchReward, an example reward actor for a non-kernel task
  gpu_validate.py  the GPU-machine validation and benchmark (`python -m actors.verifier.gpu_validate`)

Submodules are imported explicitly: this package's import must stay cheap, because every sandbox
child is forked from a process that imported it.
"""
