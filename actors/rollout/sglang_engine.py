"""The `sglang` engine (docs/rollout.md): one SGLang server per rollout actor, launched from the config
(`python -m sglang.launch_server` on the GPUs the placement plan gives the actor) or reached at
`rollout.sglang.urls` (servers or a router), driven through `SGLangClient` (which also carries SGLang's weight-update endpoints).

Weight paths: separate GPUs -> `init_weights_update_group` once, then `update_weights_from_distributed`
per bucket of each version (the learner broadcasts in that process group; flat single-dtype buckets
go with SGLang's `load_format: flattened_bucket`, one broadcast per bucket); same GPU -> SGLang's
`/update_weights_from_tensor` (CUDA IPC handles, sent by the colocated learner); fallback -> disk.
Request bodies follow SGLang's `io_struct` (InitWeightsUpdateGroupReqInput,
UpdateWeightsFromDistributedReqInput); docs/rollout.md lists what was never run against a live server.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from actors.rollout.engine import EngineError
from actors.rollout.http_client import SGLangClient
from configs import ModelConfig, RolloutConfig

log = logging.getLogger(__name__)


@dataclass
class LaunchSpec:
    model_path: str
    port: int
    gpu_ids: list[str]  # CUDA_VISIBLE_DEVICES of the server; [] = the devices this process sees
    host: str = "127.0.0.1"
    tp_size: int = 1
    mem_fraction: float = 0.8
    module: str = "sglang.launch_server"
    extra_args: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        # Kiln tokenizes itself and sends input_ids; --skip-tokenizer-init keeps SGLang from loading one.
        return [
            sys.executable,
            "-m",
            self.module,
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--tp-size",
            str(self.tp_size),
            "--mem-fraction-static",
            str(self.mem_fraction),
            "--skip-tokenizer-init",
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpu_ids)
        return env


def launch_spec(rollout: RolloutConfig, model: ModelConfig, index: int, gpu_ids: tuple[str, ...] = ()) -> LaunchSpec:
    """The server of rollout actor `index`, on `gpu_ids`: the actor's GPUs as the placement plan gave them."""
    if not model.path:
        raise EngineError("launching SGLang needs model.path (a local HF checkpoint directory)")
    sg = rollout.sglang
    if gpu_ids and len(gpu_ids) != sg.tp_size:
        raise EngineError(
            f"rollout.sglang.tp_size={sg.tp_size} but the placement gives this actor "
            f"{len(gpu_ids)} GPUs ({','.join(gpu_ids)})"
        )
    return LaunchSpec(
        model_path=model.path,
        port=sg.base_port + index,
        gpu_ids=list(gpu_ids),
        tp_size=sg.tp_size,
        mem_fraction=sg.mem_fraction,
        module=sg.launch_module,
        extra_args=list(sg.extra_args),
    )


class ServerProcess:
    """A launched server: started, waited on until /health answers, and stopped (terminate, then kill)."""

    def __init__(self, spec: LaunchSpec, start_timeout_s: float) -> None:
        self.spec = spec
        self.url = f"http://{spec.host}:{spec.port}"
        # the server's log, open for its lifetime
        self.log = tempfile.NamedTemporaryFile(prefix=f"kiln-sglang-{spec.port}-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(spec.command(), env=spec.env(), stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(start_timeout_s)
        except EngineError:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        probe = SGLangClient(self.url, timeout_s=5.0)
        deadline = time.monotonic() + timeout_s
        try:
            while not probe.health().alive:
                if self.proc.poll() is not None:
                    raise EngineError(f"server exited with {self.proc.returncode}: {self.tail()}")
                if time.monotonic() > deadline:
                    raise EngineError(f"server not healthy after {timeout_s:g}s: {self.tail()}")
                time.sleep(0.5)
        finally:
            probe.close()

    def tail(self, n: int = 2000) -> str:
        with open(self.log.name, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.proc.returncode == 0 or self.proc.returncode == -15:  # a clean stop leaves no log behind
            os.unlink(self.log.name)


class SGLangEngine(SGLangClient):
    def __init__(
        self,
        rollout: RolloutConfig,
        model: ModelConfig,
        *,
        index: int,
        eos_token_ids: list[int],
        gpu_ids: tuple[str, ...] = (),
    ) -> None:
        self.server: ServerProcess | None = None
        urls = rollout.sglang.urls
        if urls:
            url = urls[index % len(urls)]
        else:
            self.server = ServerProcess(launch_spec(rollout, model, index, gpu_ids), rollout.sglang.start_timeout_s)
            url = self.server.url
        super().__init__(url)

    def close(self) -> None:
        super().close()
        if self.server is not None:
            self.server.stop()
