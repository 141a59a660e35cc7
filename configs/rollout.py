"""The `rollout` section's schema: rollout actors, their engines (embedded torch or SGLang) and the
benchmark-only workload knobs. Part of `configs.schema.KilnConfig`; declared like every section there."""

from __future__ import annotations

from dataclasses import dataclass

from configs.fields import F

# The forced-candidate variants (actors/rollout/forced.py builds them) and their default weights.
FORCED_VARIANTS = ("solution", "compile_error", "wrong_result", "fallback", "cut_off", "hang", "crash")
FORCED_MIX = {
    "solution": 1.0,
    "compile_error": 1.0,
    "wrong_result": 1.0,
    "fallback": 1.0,
    "cut_off": 1.0,
    "hang": 0.0,
    "crash": 0.0,
}


@dataclass
class SGLangConfig:
    urls: list[str] = F([], "URLs of running SGLang servers (or one router) to use instead of launching engines")
    launch_module: str = F(
        "sglang.launch_server", "Module run as `python -m` to start one SGLang server per engine when urls is empty"
    )
    tp_size: int = F(
        1,
        "Tensor-parallel GPUs per launched SGLang server (= cluster.engine_gpus); each server runs on the GPUs the placement plan gives its actor",
        ge=1,
    )
    mem_fraction: float = F(
        0.8, "SGLang --mem-fraction-static: share of GPU memory for weights + KV cache", gt=0.0, le=1.0
    )
    base_port: int = F(
        30000, "Port of the first launched SGLang server; actor i listens on base + i", ge=1024, le=65535
    )
    start_timeout_s: float = F(600.0, "Seconds a launched SGLang server may take to answer /health", gt=0.0)
    extra_args: list[str] = F([], "Further command-line arguments for every launched SGLang server")


@dataclass
class RolloutBenchConfig:
    lengths: list[int] = F(
        [],
        "Benchmarks only (kiln bench): response lengths in tokens to draw from; every sampled (not forced) request gets its max_new_tokens drawn from them and ignores eos, so its response is exactly that long (shorter only where the context ends). A random-init policy's eos would otherwise end responses at random. [] = off: max_new_tokens and eos as usual",
    )
    length_weights: list[float] = F(
        [], "Benchmarks only: the probability of each entry of lengths (normalised; [] = equally likely)"
    )
    decode_forced: bool = F(
        False,
        "Benchmarks only: with forced_candidates, a forced attempt is decoded like a sampled one (its length drawn from lengths, with them set) and the drawn candidate is its answer, for the verifier and the dialogue's next turn: the engine does a reasoning model's decoding and the verifier a capable model's compiles. The trained tokens are the decoded ones; off = forced attempts are scored, not decoded",
    )
    unique_forced: bool = F(
        False,
        "Benchmarks only: with forced_candidates, append a unique comment to the C++ source of every drawn candidate, so each one is a real compile (no build or verdict cache hit), as every sampled kernel of a real policy would be",
    )


@dataclass
class RolloutConfig:
    engine: str = F(
        "torch",
        "Inference engine: 'torch' (embedded), 'sglang', or a dotted path to an engine class",
        choices=["torch", "sglang"],
        dotted_ok=True,
    )
    num_actors: int = F(1, "Rollout actors (each drives one engine)", ge=1)
    standby: bool = F(
        True,
        "Ray runs: keep a warm standby of each rollout actor without GPUs, a spare process started ahead (imports done, tokenizer loaded, engine built) that joins the learner for its weights and takes over when the actor dies, instead of a new process built after the death. Not for engines on GPUs (the spare would hold a second copy of the model there)",
    )
    max_batch: int = F(8, "Sequences an engine decodes at once", ge=1)
    prefix_cache_tokens: int = F(
        -1,
        "The embedded torch engine's prefix cache, in tokens: keys and values of the contexts it computed, kept so that a group's later attempts (the same prompt) and a dialogue's next turn (the dialogue so far) copy their shared beginning instead of prefilling it again; emptied at every weight update. -1 = 4 × model.max_seq_len, 0 = off",
        ge=-1,
    )
    max_new_tokens: int = F(512, "Length limit of one response; longer ones are cut and flagged truncated", ge=1)
    temperature: float = F(1.0, "Sampling temperature T; behaviour logprobs are log softmax(logits / T)", gt=0.0)
    top_p: float = F(
        1.0, "Nucleus sampling; 1.0 keeps the logprob convention exact (no renormalisation)", gt=0.0, le=1.0
    )
    top_k: int = F(0, "Top-k sampling; 0 disables it", ge=0)
    max_attempts_at_engine: int = F(
        0,
        "Engine budget of a rollout actor, in attempts at its engine (queued or generating): a new task group starts whenever fewer are there, the token budget has room and replay's admission allows it (a group may overshoot by up to G-1 attempts); 0 = 2 × max_batch, a full batch and as many queued behind it. Attempts being verified do not count (max_attempts_at_verifiers bounds them), so slow verifications never starve the engine",
        ge=0,
    )
    max_attempts_at_verifiers: int = F(
        0,
        "Verification budget of a rollout actor, in attempts sent to verifiers and not answered: a new task group starts only while fewer wait there, so a verifier slower than the engine builds no backlog that would outlast verify_reply_timeout_s or η (the engine waits instead); 0 = 2 × max_batch",
        ge=0,
    )
    max_tokens_in_flight: int = F(
        0,
        "Token budget of a rollout actor at its engine: the attempts whose requests are at the engine reserve their prompt plus max_new_tokens each, and a new task group starts only while one more attempt's expected reservation fits; 0 = 2 × max_batch × model.max_seq_len (a full batch of the longest rows and as many queued behind it). For a paged-KV engine (SGLang), its KV pool's tokens plus a queue",
        ge=0,
    )
    max_turns: int = F(
        3,
        "Turns T per episode: the first attempt plus up to T-1 repair or performance turns with verifier feedback",
        ge=1,
    )
    history: str = F(
        "full",
        "What a repair prompt shows of the attempt so far: 'full' = the task and every earlier answer and its feedback as a dialogue; 'last' = the task, the last answer and its feedback. Either way older turns are left out (and the prompt says so) when the dialogue plus max_new_tokens would exceed model.max_seq_len",
        choices=["full", "last"],
    )
    history_thinking: bool = F(
        False,
        "Earlier answers in a repair prompt keep their thinking text; false leaves it out (it stays in the episode)",
    )
    optimize_turns: int = F(
        1,
        "Performance turns: a kernel that passes with a speedup vs eager below optimize_until gets up to this many turns (within max_turns) with the timing of it and of each baseline, asking for a faster kernel; 0 = a pass ends the attempt",
        ge=0,
    )
    optimize_until: float | None = F(
        None,
        "A passing kernel whose speedup vs eager PyTorch is below this is slow: it gets a performance turn while optimize_turns and max_turns allow; null = eval.fast_threshold, the speedup the evaluation counts as faster",
        gt=0.0,
    )
    on_weight_update: str = F(
        "finish",
        "A weight update mid-generation: 'finish' in-flight requests on the old weights (new requests wait: the batch "
        "drains before each update), or 'abort' and resume them on the new (the GPU presets: the batch stays full)",
        choices=["finish", "abort"],
    )
    verify_reply_timeout_s: float = F(
        600.0, "Seconds a rollout actor waits for a verifier's answer to one attempt before resending it", gt=0.0
    )
    verify_retries: int = F(1, "Resends before an attempt is marked 'infra' (not a policy failure)", ge=0)
    sglang: SGLangConfig = F(
        SGLangConfig(), "SGLang engines (rollout.engine=sglang): launched per actor, or reached at running servers"
    )
    device: str = F("auto", "Device of the embedded torch engine: 'auto' (cuda when present), 'cpu' or 'cuda[:i]'")
    seed: int = F(0, "Seed of the engine's sampler (each actor adds its index)", ge=0)
    task_wait_s: float = F(5.0, "Seconds to wait for the task feed to answer before asking again", gt=0.0)
    ack_timeout_s: float = F(5.0, "Seconds to wait for replay to acknowledge an episode before resending", gt=0.0)
    forced_candidates: str | None = F(
        None,
        "Benchmarks and the CPU demo only: a solutions directory; attempts are drawn from candidates built from it (the solution, compile-broken, wrong-result, fallback and cut-off variants) and scored by the engine instead of sampled; null = sample (the default)",
    )
    forced_fraction: float = F(
        1.0,
        "With forced_candidates: the share of attempts drawn from the pool; the others are sampled (benchmarks that also need real decoding)",
        ge=0.0,
        le=1.0,
    )
    forced_mix: dict[str, float] = F(
        dict(FORCED_MIX),
        "With forced_candidates: the weight of each variant in a draw (solution, compile_error, wrong_result, fallback, cut_off, hang: an endless loop, a timeout verdict that costs verifier.run_timeout_s, crash: a null write when the kernel runs, a runtime verdict); a draw picks a variant the task has with probability proportional to its weight. Variants left out of a YAML mapping keep these defaults",
    )
    torch_threads: int = F(
        0,
        "Intra-op threads of the embedded torch engine (torch.set_num_threads in its process; in-process runs share one process, so the last actor to start sets it); 0 = leave torch's default (Ray actors: 1)",
        ge=0,
    )
    bench: RolloutBenchConfig = F(
        RolloutBenchConfig(), "Benchmark-only workload knobs (kiln bench); all off by default"
    )
