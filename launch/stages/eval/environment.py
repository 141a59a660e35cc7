"""What an evaluation's numbers depend on besides the answers: the verifier settings, the device
and the toolchain. The JSON summary records them; `--compare` warns when two evaluations differ."""

from __future__ import annotations

import dataclasses
import platform

from configs import VerifierConfig

# Settings that say where things are, not how verdicts are reached.
_NOT_SETTINGS = ("cache_dir", "num_actors", "compile_workers", "run_workers", "max_concurrent_requests")


def verifier_settings(cfg: VerifierConfig) -> dict:
    d = dataclasses.asdict(cfg)
    return {k: v for k, v in d.items() if k not in _NOT_SETTINGS}


def device_name(backend: str) -> str:
    if backend == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 - a broken driver is recorded as such, it does not stop the evaluation
            return "cuda (device name unavailable)"
        return "cuda (no device visible)"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"cpu: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()}"


def toolchain(backend: str) -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda or ""}
    try:
        from actors.verifier.build.toolchain import Toolchain

        tc = Toolchain.detect(backend)
        out.update({"cxx": f"{tc.cxx} {tc.cxx_version}".strip(), "nvcc": tc.nvcc_version})
    except Exception as err:  # noqa: BLE001 - no compiler: the verdicts say so; the record names why
        out["toolchain_error"] = " ".join(str(err).split())[:200]
    return out
