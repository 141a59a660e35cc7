"""A run's verdict where device memory decided it (cuda): the evidence is gpumem.py's (the driver's
figures, the device watch); this module writes what it says into the run's outcome. Three cases:

* the device watch stopped this run's sandbox for holding more than its share while the device ran
  low: `runtime`, whatever else the run ended with; an out-of-memory of this run while *another*
  sandbox overran is the machine's (`infra`);
* the verifier's own work (references, snapshots) ran out of memory while the sandbox was alive: the
  candidate's fault when its sandbox held more than its share, else the machine's (gpumem.trusted_oom);
* the candidate's own code reported an out-of-memory: the machine's only on the driver's word that
  the device could not give the sandbox its share (gpumem.sandbox_oom); the text alone never decides.
"""

from __future__ import annotations

from actors.verifier import gpumem
from actors.verifier.executor import ChildSession
from actors.verifier.outcome import RunOutcome


class DeviceVerdicts:
    """For one run: `device` the reference's device, `gpu_uuid` its GPU (the watch's key), `share` the
    device bytes its sandbox may hold (gpumem.share)."""

    def __init__(self, device: str, gpu_uuid: str, share: int) -> None:
        self.device, self.gpu_uuid, self.share = device, gpu_uuid, share

    def watch_word(self, out: RunOutcome, watched: gpumem.Watched | None) -> None:
        """The device watch's word, over whatever else the run ended with (gpumem's docstring)."""
        if watched is None:
            return
        if watched.overrun is not None:
            out.violations = [v for v in out.violations if v.kind != "exit"]  # the watch's kill, not an exit
            out.limits["device_memory"] = watched.overrun.to_json()
            out.stage, out.error_class = "run", "runtime"
            out.message = gpumem.overrun_message(watched.overrun)
            return
        if out.error_class not in ("runtime", "infra") or "out of memory" not in (out.message or "").lower():
            return
        watch = gpumem.device_watch(self.gpu_uuid)
        others = watch.overruns_since(watched.since, exclude=watched) if watch is not None else []
        if others:
            out.error_class = "infra"
            out.message = f"{gpumem.crowded_out(others)} ({out.message[:300]})"

    def verifier_oom(self, out: RunOutcome, child: ChildSession, err: Exception, doing: str) -> None:
        """The verifier's own work ran out of device memory while `child` was alive."""
        evidence = gpumem.take(child, self.device, self.gpu_uuid, self.share, may_kill=True)
        out.limits["device_memory"] = evidence.to_json()
        error_class, message = gpumem.trusted_oom(evidence)
        out.stage, out.error_class = "run", error_class
        out.message = f"{message} (while {doing}: {str(err).splitlines()[0][:200]})"

    def candidate_oom(self, out: RunOutcome, child: ChildSession) -> None:
        """The candidate's own code reported a CUDA out-of-memory (a `runtime` outcome, sandbox alive)."""
        said = out.message
        if out.error_class != "runtime" or not child.alive:
            return
        if "out of memory" not in said.lower() and "OutOfMemoryError" not in said:
            return
        # The run ends here either way (its error stopped it): the sandbox may be killed to measure it.
        evidence = gpumem.take(child, self.device, self.gpu_uuid, self.share, may_kill=True)
        out.limits["device_memory"] = evidence.to_json()
        error_class, note = gpumem.sandbox_oom(evidence)
        if error_class == "infra":
            out.error_class = "infra"
            out.message = f"{note} ({out.message[:300]})"
