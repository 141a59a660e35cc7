"""Weight transport from the learner to the engines: one module per transport (`gloo`, `nccl`,
`cuda_ipc`, `disk`; gloo and nccl share `group`), each with the learner's end (a `Sender`) and an
engine's end (a `Loader`) of the interface in `base`. `sender` and `loader` build them by name;
`choose_transport` resolves `learner.weight_sync: auto`."""

from actors.policy.weights.base import Loader, Sender, SenderSettings
from actors.policy.weights.cuda_ipc import IpcLoader, IpcSender
from actors.policy.weights.disk import DiskLoader, DiskSender
from actors.policy.weights.gloo import GlooLoader, GlooSender
from actors.policy.weights.nccl import NcclLoader, NcclSender

SENDERS: dict[str, type[Sender]] = {c.name: c for c in (GlooSender, NcclSender, IpcSender, DiskSender)}
LOADERS: dict[str, type[Loader]] = {c.name: c for c in (GlooLoader, NcclLoader, IpcLoader, DiskLoader)}
TRANSPORTS = tuple(SENDERS)


def sender(transport: str, settings: SenderSettings) -> Sender:
    if transport not in SENDERS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    return SENDERS[transport](settings)


def loader(transport: str) -> Loader:
    if transport not in LOADERS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    return LOADERS[transport]()


def choose_transport(weight_sync: str, learner_device: str, shares_gpu: bool) -> str:
    """The transport for `learner.weight_sync`: "auto" is gloo on CPU, cuda_ipc when the engines share
    the learner's GPU (colocated), nccl otherwise; any other value is used as given."""
    if weight_sync != "auto":
        return weight_sync
    if not learner_device.startswith("cuda"):
        return "gloo"
    return "cuda_ipc" if shares_gpu else "nccl"
