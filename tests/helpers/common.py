"""Small tools many test modules share: waiting for a condition, a free TCP port, whether a process runs
under a sandbox's uid, and the reference logprobs of a response from one full-sequence forward."""

from __future__ import annotations

import socket
import time


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition", actor=None, poll_s: float = 0.05) -> None:
    """Poll `predicate` every `poll_s` until it holds; fail naming `what` after `timeout_s`. With `actor` (a
    rollout actor), also fail as soon as its episode loop has died."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert actor is None or actor.health().looping, "the episode loop died"
        time.sleep(poll_s)


def runs_as_sandbox(pid: int) -> bool:
    """Whether process `pid` runs under one of the verifier sandboxes' uids (False once it is gone)."""
    from actors.verifier.jail import SANDBOX_UID_BASE, SANDBOX_UID_SPAN

    try:
        with open(f"/proc/{pid}/status") as f:
            uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration):
        return False
    return SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + SANDBOX_UID_SPAN


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_logprobs(model, prompt, output, temperature: float = 1.0):
    """log softmax(logits / T) of `output` from one full-sequence forward of the same model (a numpy array)."""
    import torch

    prompt, output = [int(t) for t in prompt], [int(t) for t in output]
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + output], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = torch.tensor(output, device=device)[:, None]
    return torch.log_softmax(logits / temperature, -1).gather(1, chosen)[:, 0].cpu().numpy()
