"""The embedded `torch` engine (docs/rollout.md): an HF transformers causal LM served with a static KV
cache, batched decoding and continuous batching, on CPU or GPU.

One scheduler thread owns the model. `generate()` from any thread queues requests and waits; the
scheduler admits queued requests into free batch slots, decodes one token for every row per step,
and finishes rows at a stop token or a length limit (flagged "length", i.e. truncated).

Continuous batching: the engine holds `max_batch` slots in one KV cache of `max_seq_len` columns,
allocated once (actors/rollout/static_batch.py). Each slot keeps its own length, so a request is
admitted into any free slot whatever the others' lengths (while rows decode, once `admit_batch` slots
are free, so one prefill serves several rows): only the admitted rows' contexts are prefilled (into a
small cache of their own) and copied into their slots. The running rows are never touched, nothing is
re-prefilled for an admission, and the decode step (its buffers, its CUDA graphs) lives as long as the
cache. Every live row is prefilled again, into its own slot, only after new weights land (a
"rebuild"). Logprobs already emitted are never recomputed, so each token keeps the exact logprob and
weight version it was sampled with.

Decode speed: the step is pipelined (step t+1's decode is queued on the GPU before the host reads
step t's tokens, so bookkeeping overlaps the GPU); decoding attends over the un-repeated KV heads,
on CUDA each slot only up to its own column (actors/rollout/attention.py, decode_kernel.py); on CUDA
the step is compiled once and replayed from a CUDA graph (decode_step.py). None of it changes which
token is recorded with which logprob and version.

Weight updates run on the scheduler thread between two decode steps, so a token's version is exact.
Policy "abort": apply at the next step boundary; running rows are re-prefilled on the new weights
and continue (abort-and-resume). Policy "finish": new requests wait until the running ones finish on
the old weights, then the update applies.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from actors.policy.model import build_model
from actors.policy.sampling import sample, token_logprobs
from actors.rollout import attention, static_batch
from actors.rollout.engine import Engine, EngineError, GenerateRequest, Generation, RequestError
from actors.rollout.prefix_cache import PrefixCache
from actors.rollout.static_batch import Row, Slots
from configs import ModelConfig
from protocols import EngineHealth
from protocols.lease import DeviceLease

log = logging.getLogger(__name__)


class TorchEngine(Engine):
    def __init__(
        self,
        model_cfg: ModelConfig,
        *,
        max_batch: int = 8,
        device: str = "cpu",
        eos_token_ids: Iterable[int] = (),
        on_weight_update: str = "finish",
        seed: int = 0,
        version: int = 0,
        cuda_graphs: bool = True,
        pipeline: bool = True,
        gqa_decode: bool = True,
        compiled: bool = True,
        admit_batch: int | None = None,
        prefix_cache_tokens: int = -1,
    ) -> None:
        if on_weight_update not in ("finish", "abort"):
            raise ValueError(f"on_weight_update must be 'finish' or 'abort', got {on_weight_update!r}")
        self.model_cfg = model_cfg
        self.max_batch = max_batch
        self.device = torch.device(device)
        self.eos = frozenset(eos_token_ids)
        self.policy = on_weight_update
        self.cuda_graphs = cuda_graphs  # capture the decode step on GPU (ignored on CPU)
        self.pipeline = pipeline  # launch step t+1's decode before reading step t's tokens (see _step)
        # Slots freed before queued requests are admitted while rows decode (_admit); None: an eighth of
        # the batch (at least 1).
        self.admit_batch = admit_batch or max(1, max_batch // 8)
        self.compiled = compiled  # torch.compile the graph-captured decode step (CUDA with triton; decode_step.py)
        # gqa_decode: attend over the un-repeated KV heads when decoding (actors/rollout/attention.py)
        self.model = build_model(model_cfg, self.device, attention=attention.register() if gqa_decode else "sdpa")
        # A checkpoint's own config decides its vocabulary and longest context.
        self.vocab_size = self.model.config.vocab_size
        self.max_seq_len = min(model_cfg.max_seq_len, self.model.config.max_position_embeddings)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # Keys and values of computed contexts, for the rows that extend them (prefix_cache.py); -1: four
        # of the longest contexts, 0: off.
        budget = 4 * self.max_seq_len if prefix_cache_tokens < 0 else prefix_cache_tokens
        self._prefix = PrefixCache(budget) if budget > 0 else None
        self._version = version
        self._cv = threading.Condition()
        self._queue: collections.deque[Row] = collections.deque()
        self._updates: collections.deque[tuple[Callable[[], None], int | None, Future]] = collections.deque()
        self._aborts: set[str] = set()
        self._abort_all = False
        self._paused = False
        self._released = False
        self._closed = False
        self._slots: Slots | None = None  # allocated at the first admission, dropped by release_memory
        self._unplaced: list[Row] = []  # live rows waiting for their slot again (new weights, memory back)
        self._groups: dict[str, object] = {}  # weight-broadcast groups joined, by name
        self._staged: dict[str, list[tuple[str, torch.Tensor]]] = {}  # received buckets of a version, by group
        self.stats = {
            "requests": 0,
            "tokens": 0,
            "rebuilds": 0,
            "inserted": 0,
            "steps": 0,
            # Decode steps taken while requests waited in the queue, and the rows they decoded: how
            # full the batch is kept when there is work to fill it (kiln bench reports the ratio).
            "queued_steps": 0,
            "queued_rows": 0,
            "graph_steps": 0,
            # Context tokens the prefill forward computed, and those written into slots: a group's
            # attempts admitted together share their prompt's prefill (static_batch.fill).
            "prefilled": 0,
            "placed": 0,
            "updates": 0,
            "aborted": 0,
        }
        self.step_hook: Callable[[int], None] | None = None  # tests: called after each decode step
        # Each cycle of work on the device holds the shared device lease: a verifier timing a kernel on
        # this device holds it exclusively, and the engine waits between its steps until it is done.
        self.lease = DeviceLease(str(self.device))
        self._thread = threading.Thread(target=self._run, name="kiln-torch-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls, rollout, model, *, index: int, eos_token_ids: list[int], gpu_ids: tuple[str, ...] = ()
    ) -> TorchEngine:
        # In a Ray actor the placement already restricts the visible devices to `gpu_ids`.
        from actors.rollout.engines import resolve_device

        if rollout.torch_threads:  # the whole process's intra-op pool: in a Ray actor, this engine's own
            torch.set_num_threads(rollout.torch_threads)
        return cls(
            model,
            max_batch=rollout.max_batch,
            device=resolve_device(rollout.device),
            eos_token_ids=eos_token_ids,
            on_weight_update=rollout.on_weight_update,
            seed=rollout.seed + index,
            prefix_cache_tokens=rollout.prefix_cache_tokens,
        )

    # ------------------------------------------------------------------------------ interface

    def generate(self, requests: list[GenerateRequest]) -> list[Generation]:
        rows = [self._row(r) for r in requests]
        with self._cv:
            if self._closed:
                raise EngineError("engine is closed")
            self._queue.extend(rows)
            self.stats["requests"] += len(rows)
            self._cv.notify_all()
        return [row.future.result() for row in rows]

    def submit(self, request: GenerateRequest) -> Future:
        """Queue one request; its future is the row's own (no thread waits on it)."""
        row = self._row(request)
        with self._cv:
            if self._closed:
                raise EngineError("engine is closed")
            self._queue.append(row)
            self.stats["requests"] += 1
            self._cv.notify_all()
        return row.future

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        with self._cv:
            if request_ids is None:
                self._abort_all = True
            else:
                self._aborts.update(request_ids)
            self._cv.notify_all()

    def pause(self) -> None:
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def release_memory(self) -> None:
        self._apply_on_scheduler(self._release, None)

    def resume_memory(self) -> None:
        self._apply_on_scheduler(self._reacquire, None)

    def update_weights_from_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = list(tensors)  # materialise on the caller's thread (it may stream from a socket)
        self._apply_on_scheduler(lambda: self._load(named), version)

    def update_weights_from_disk(self, path: str, version: int) -> None:
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise EngineError(f"no *.safetensors in {path}")
        named = [item for f in files for item in load_file(str(f)).items()]
        self._apply_on_scheduler(lambda: self._load(named), version)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        from actors.policy.weights.group import WeightReceiver

        self._staged.pop(group_name, None)
        try:
            self._groups[group_name] = WeightReceiver(
                master_address,
                master_port,
                rank_offset,
                world_size,
                group_name=group_name,
                backend=backend,
                device=self.device,
            )
        except (RuntimeError, ValueError) as err:
            raise EngineError(f"joining weight group {group_name!r} failed: {err}") from None

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        group_name: str = "weight_update_group",
        *,
        last: bool = True,
        flat: bool = False,
    ) -> None:
        receiver = self._groups.get(group_name)
        if receiver is None:
            raise RequestError(f"no weight group {group_name!r}: call init_weights_update_group first")
        try:  # receive on the caller's thread: the learner's broadcast never waits for a step boundary
            named = receiver.receive(names, dtypes, shapes, flat=flat)  # flat: views of the received bucket
        except (RuntimeError, ValueError) as err:
            self._staged.pop(group_name, None)  # a version cut short is never applied in part
            raise EngineError(f"receiving weights for version {version} failed: {err}") from None
        # Buckets of one version are staged and applied in one scheduler update, so no decode step ever
        # runs on a half-updated model (the cost: one extra copy of the weights while staging).
        staged = self._staged.setdefault(group_name, [])
        staged.extend(named)
        if not last:
            return
        del self._staged[group_name]
        self._apply_on_scheduler(lambda: self._load(staged), version)

    @property
    def weight_version(self) -> int:
        return self._version

    def health(self) -> EngineHealth:
        with self._cv:
            return EngineHealth(
                alive=self._thread.is_alive() and not self._closed,
                version=self._version,
                queued=len(self._queue),
                running=len(self._running()),
                paused=self._paused,
                released=self._released,
                **self.stats,
            )

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------------------ scheduler

    def _row(self, req: GenerateRequest) -> Row:
        if not req.prompt_ids:
            raise RequestError(f"request {req.request_id}: empty prompt")
        bad = [t for t in req.prompt_ids + (req.forced_response or []) if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"request {req.request_id}: token ids out of vocabulary: {bad[:5]}")
        if len(req.prompt_ids) >= self.max_seq_len:
            raise RequestError(
                f"request {req.request_id}: prompt of {len(req.prompt_ids)} tokens >= max_seq_len {self.max_seq_len}"
            )
        stops = frozenset(req.params.stop_token_ids) | (frozenset() if req.params.ignore_eos else self.eos)
        return Row(req=req, future=Future(), stops=stops)

    def _apply_on_scheduler(self, fn: Callable[[], None], version: int | None) -> None:
        """Run `fn` on the scheduler thread between decode steps; `version` (None: unchanged) is served
        from then on."""
        done: Future = Future()
        with self._cv:
            if self._closed:
                raise EngineError("engine is closed")
            self._updates.append((fn, version, done))
            self._cv.notify_all()
        done.result()

    def _run(self) -> None:
        try:
            while self._cycle():
                pass
        except Exception as err:  # the engine is dead: fail everything waiting so callers restart it
            log.exception("torch engine crashed")
            with self._cv:
                self._closed = True
                pending = [r.future for r in self._queue] + [u[2] for u in self._updates]
                pending += [r.future for r in self._running() if not r.future.done()]
            for fut in pending:
                if not fut.done():
                    fut.set_exception(EngineError(f"engine crashed: {err!r}"))

    def _cycle(self) -> bool:
        """One scheduling decision and at most one decode step. False once closed."""
        with self._cv:
            while not self._closed and not self._ready():
                self._cv.wait(timeout=0.5)
            if self._closed:
                self._fail_all(EngineError("engine is closed"))
                return False
            update = self._updates.popleft() if self._update_due() else None
            # Nothing is admitted in a cycle that runs an update (that cycle ends after the update, so
            # rows taken off the queue here would be lost), nor while an update waits under "finish".
            hold = update is not None or (self._updates and self.policy == "finish")
            admitted = [] if hold else self._admit()
            waited = bool(self._queue)  # requests left waiting after this cycle's admission
            self._take_aborts()
            held = self._paused or self._released
        if update is not None:
            self._run_update(*update)
            return True
        self._finish_aborted()
        if held:  # aborts are answered while paused; decoding waits for resume()
            return True
        # The decode cycle holds the shared device lease: a verifier timing a kernel on this device
        # holds it exclusively, and decoding waits between cycles until the window closes.
        with self.lease.shared():
            forced = [r for r in admitted if r.req.forced_response is not None]
            if forced:
                self._score_forced(forced)
            sampled = [r for r in admitted if r.req.forced_response is None]
            if self._unplaced or sampled:
                self._place(sampled)
            if self._slots is not None and self._slots.live:
                self._step(waited)
        return True

    def _running(self) -> list[Row]:
        """The rows generating: in their slots, or waiting to be put back in one."""
        slotted = [r for r in self._slots.rows if r is not None] if self._slots else []
        return slotted + self._unplaced

    def _ready(self) -> bool:
        if (self._updates and self._update_due()) or self._abort_all or self._aborts:
            return True
        if self._paused or self._released:
            return False
        return bool(self._running()) or bool(self._queue) or self._abort_all or bool(self._aborts)

    def _update_due(self) -> bool:
        if not self._updates:
            return False
        return self.policy == "abort" or not self._running()

    def _admit(self) -> list[Row]:
        """Queued requests for this cycle. A sampled request needs a free slot; while rows decode, those
        admissions wait until `admit_batch` slots are free (or every queued sampled request fits): one
        prefill forward's fixed cost (an eager pass, launch-bound on GPU) is then shared by that many
        rows instead of paid per row, and the batch never drops below max_batch - admit_batch + 1 rows
        while sampled requests wait. A forced request is scored this cycle and takes no slot, so it is
        taken whatever the slots (up to max_batch a cycle, which bounds the cycle's scoring): counted
        against the free slots, it left one empty while a sampled request waited."""
        if not self._queue or self._paused or self._released:
            return []
        running = len(self._running())
        free = self.max_batch - running
        sampled = sum(r.req.forced_response is None for r in self._queue)
        if running and free < min(self.admit_batch, sampled):
            free = 0
        forced = self.max_batch
        taken: list[Row] = []
        kept: collections.deque[Row] = collections.deque()
        for row in self._queue:
            if row.req.forced_response is not None and forced > 0:
                forced -= 1
                taken.append(row)
            elif row.req.forced_response is None and free > 0:
                free -= 1
                taken.append(row)
            else:
                kept.append(row)
        self._queue = kept
        return taken

    def _take_aborts(self) -> None:
        for row in self._running():
            if self._abort_all or row.req.request_id in self._aborts:
                row.finish = "abort"
        for row in list(self._queue):
            if self._abort_all or row.req.request_id in self._aborts:
                self._queue.remove(row)
                row.finish = "abort"
                self._resolve(row)
        self._aborts.clear()
        self._abort_all = False

    def _finish_aborted(self) -> None:
        for slot in self._slots.live if self._slots else []:
            if self._slots.rows[slot].finish == "abort":
                self._end(self._slots.rows[slot], slot)
        for row in [r for r in self._unplaced if r.finish == "abort"]:
            self._unplaced.remove(row)
            self._end(row, None)

    def _end(self, row: Row, slot: int | None) -> None:
        """Answer a finished row and free its slot; a row that ended by itself leaves its context's keys
        and values in the prefix cache first (its dialogue's next turn starts with them)."""
        self.stats["aborted"] += row.finish == "abort"
        self._resolve(row)
        if slot is not None:
            if self._prefix is not None and row.finish in ("stop", "length"):
                static_batch.keep(self._slots, slot, self._prefix)
            static_batch.park(self._slots, slot)

    def _unslot(self) -> None:
        """Take every live row out of its slot, to be prefilled again (its keys and values are stale)."""
        if self._slots is not None:
            for slot in self._slots.live:
                self._unplaced.append(self._slots.rows[slot])
                static_batch.park(self._slots, slot)

    def _run_update(self, fn: Callable[[], None], version: int | None, done: Future) -> None:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - a bad update is the caller's error; the old weights keep serving
            done.set_exception(EngineError(f"weight update to version {version} failed: {err}"))
            return
        if version is not None:
            self._version = version
            self.stats["updates"] += 1
        if self._prefix is not None:
            self._prefix.clear()
        self._unslot()  # the cached keys/values belong to the old weights
        done.set_result(None)

    def _fail_all(self, err: Exception) -> None:
        for row in list(self._queue) + self._running():
            if not row.future.done():
                row.future.set_exception(err)
        for _, _, fut in self._updates:
            fut.set_exception(err)

    # ---------------------------------------------------------------------------------- model

    @torch.no_grad()
    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        params = self.model.state_dict()
        unknown = [n for n, _ in named if n not in params]
        if unknown:
            raise KeyError(f"unknown parameter names {unknown[:3]}")
        for name, tensor in named:
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
        for name, tensor in named:
            params[name].copy_(tensor)

    def _release(self) -> None:
        if self._prefix is not None:
            self._prefix.clear()
        self._unslot()
        self._slots = None  # the cache and the decode step's graphs go; allocated again at the next admission
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._released = True

    def _reacquire(self) -> None:
        self.model.to(self.device)
        self._released = False

    @torch.no_grad()
    def _score_forced(self, rows: list[Row]) -> None:
        """Forced-response mode: one full forward per row gives the logprobs of the given tokens."""
        for row in rows:
            resp = row.req.forced_response
            ids = torch.tensor([row.req.prompt_ids + resp], device=self.device)
            logits = self.model(input_ids=ids).logits[0, len(row.req.prompt_ids) - 1 : -1]
            lp = token_logprobs(logits, torch.tensor(resp, device=self.device), row.req.params.temperature)
            row.out, row.logprobs = list(resp), lp.tolist()
            row.versions = [self._version] * len(resp)
            row.finish = "length" if len(resp) >= row.req.params.max_new_tokens else "stop"
            self._resolve(row)

    def _place(self, admitted: list[Row]) -> None:
        """Put the rows waiting for their slot again, then the `admitted` ones, into free slots: each
        prefilled once per distinct context, no running row touched (static_batch.fill). _admit took no
        more than fit."""
        refill = [r for r in self._unplaced if not self._finish_if_full(r)]
        admitted = [r for r in admitted if not self._finish_if_full(r)]
        self._unplaced = []
        if not refill and not admitted:
            return
        if self._slots is None:
            self._slots = static_batch.allocate(
                self.model,
                self.max_batch,
                self.max_seq_len,
                self.device,
                cuda_graphs=self.cuda_graphs,
                compiled=self.compiled,
            )
        rows = refill + admitted
        computed, placed = static_batch.fill(
            self.model, self._slots, list(zip(self._slots.free, rows, strict=False)), self.device, self._prefix
        )
        self.stats["prefilled"] += computed
        self.stats["placed"] += placed
        self.stats["rebuilds"] += bool(refill)
        self.stats["inserted"] += len(admitted)

    def _budget(self, row: Row) -> int:
        context = len(row.req.prompt_ids) + len(row.out)
        return min(row.req.params.max_new_tokens - len(row.out), self.max_seq_len - context)

    def _finish_if_full(self, row: Row) -> bool:
        if self._budget(row) > 0:
            return False
        row.finish = "length"
        self._resolve(row)
        return True

    @torch.no_grad()
    def _step(self, waited: bool = False) -> None:
        """Sample one token for every slot, record the live rows', finish rows and free their slots.
        `waited`: requests were left in the queue by this cycle's admission (counted in the stats).
        Pipelined: the next decode is queued on the GPU before this step's tokens are read on the host,
        so the GPU computes step t+1 while Python does step t's bookkeeping. A row that then finishes
        only parks its slot; that decode's logits for it are never read (nothing of it is recorded;
        the RNG is only drawn by sample(), so the tokens are the same with pipelining on or off)."""
        s = self._slots
        tokens, logprobs = sample(s.logits, s.temperature, s.top_p, s.top_k, self.generator, filtered=s.filtered)
        host_tokens, host_lps = s.sampled
        host_tokens.copy_(tokens, non_blocking=True)
        host_lps.copy_(logprobs, non_blocking=True)
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        if ready is not None:
            ready.record()
        # The columns and slots this step's decode reads, fixed before any row finishes: the same
        # whether the decode runs ahead or after the bookkeeping, so both run the same shapes.
        longest, highest = s.longest(), s.highest()
        ahead = self.pipeline and self._decode_ahead_useful(s)
        if ahead:
            self._decode(tokens, longest, highest)
        if ready is not None:
            ready.synchronize()
        token_list, lp_list = host_tokens.tolist(), host_lps.tolist()
        if waited:
            self.stats["queued_steps"] += 1
            self.stats["queued_rows"] += len(s.live)
        for slot in s.live:
            row = s.rows[slot]
            tok = token_list[slot]
            row.out.append(tok)
            row.logprobs.append(lp_list[slot])
            row.versions.append(self._version)
            self.stats["tokens"] += 1
            if tok in row.stops:
                row.finish = "stop"
            elif self._budget(row) <= 0:
                row.finish = "length"
            if row.finish:
                self._end(row, slot)
        self.stats["steps"] += 1
        if not ahead and s.live:
            self._decode(tokens, longest, highest)
        if self.step_hook is not None:
            self.step_hook(self.stats["steps"])

    def _decode_ahead_useful(self, s: Slots) -> bool:
        """Whether to decode before this step's tokens are known: not when the host already knows every
        live row ends after this step (each at its length limit)."""
        return any(self._budget(s.rows[slot]) > 1 for slot in s.live)

    def _decode(self, tokens: torch.Tensor, longest: int, highest: int) -> None:
        s = self._slots
        s.logits = s.step(tokens, longest, highest)
        static_batch.advanced(s)
        self.stats["graph_steps"] += s.step.on_graph

    def _resolve(self, row: Row) -> None:
        if row.future.done():
            return
        row.future.set_result(
            Generation(
                request_id=row.req.request_id,
                output_ids=np.asarray(row.out, dtype=np.int64),
                logprobs=np.asarray(row.logprobs, dtype=np.float32),
                versions=np.asarray(row.versions, dtype=np.int64),
                finish_reason=row.finish or "abort",
                prompt_tokens=len(row.req.prompt_ids),
                seconds=time.monotonic() - row.start,
            )
        )
