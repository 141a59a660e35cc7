"""The staged kernel verifier and the reward-actor interface.

The trust boundary: whatever runs candidate code is untrusted (every jailed process below); the
verdict, the comparison, the clock that counts and the verdict cache live in the verifier's own
process. Where things are:
  actor.py       VerifierActor: the ROUTER service around any reward actor, with its guard
  interface.py   the reward-actor interface (`RewardActor`), loaded by `actors.base.load_plugin`
  verifier.py    KernelVerifier: extract -> static scan -> compile -> run/correctness -> performance
  extract.py     stage 1: code from model output
  legality.py    the legality policy and the static scan; fence.py (the seal) is its runtime half,
                 build/symbols.py its check of built libraries
  native/        the sandbox's native half: kiln_native (C: the one-way arm switch, the audit hook,
                 refusers, the evidence log, the OS calls of the jail) and kiln_fence (C++: the
                 compute fence at the dispatcher, the sandbox's own plumbing copies), built by the
                 build service; shim.py, the stand-in for ctypes that keeps raw memory out of the zygote
  build/         the compile subsystem (BuildService: jailed capture and build processes, symbol check)
  jail.py, seccomp.py, isolation.py, zygote.py   the confinement (namespaces, uid, filesystem; the
                 seccomp filters), what each kind of process sees, and the one fork server of every
                 jailed process
  executor.py, sandbox.py, sealed.py, wire.py   the execution sandbox (sandbox.py until it seals,
                 sealed.py's request loop after: signed replies, the I/O arena) and its channel
  workers.py, lanes.py   how many compile and sandbox workers, and the per-GPU lanes they run in
  reference.py, compare.py, runner.py, performance.py, outcome.py, baselines.py, timing.py,
                 tensors.py   the trusted side (runner.py drives a run and performance.py its timed
                 calls, outcome.py is what it established; protocols/lease.py: the
                 device lease shared with engines and learners); families.py, the input families
                 the correctness trials are drawn from; baseline_worker.py, the lane's process that
                 times the references and runs nothing else
  reference_program.py, jailed_reference.py, reference_child.py   where a reference's own code runs:
                 reference.py's logic over a program, in this process (the operator's task set) or in
                 a jailed process of its own (a reference a client sent: its module, draws, forward
                 and baselines), which the verifier treats as untrusted data
  provenance.py  whose code did the work: the rules, over sampling.py (perf samples of a cpu sandbox,
                 taken from outside it), attribution.py (the table that names a sample's owner by
                 symbol) and cubins.py (the kernels a CUDA build defines), and the device's record of
                 what ran in a cuda sandbox (sealed.py's trace)
  gpumem.py      whose device memory: the driver's figure of a sandbox's, and the rules that decide an
                 out-of-memory (the candidate's or the machine's) by it
  reward.py      the MooreEval score and the feedback texts; verdicts.py: the authenticated verdict cache;
                 redact.py: what leaves the verifier (feedback, diagnostics), bounded and without host details
  examples.py    TextMatchReward, an example reward actor for a non-kernel task
The verifier's own tools live in launch/bench/ (`gpu_verifier`, `compile`, `gpu_compile`).

Submodules are imported explicitly: this package's import must stay cheap, because every sandbox
child is forked from a process that imported it.
"""
