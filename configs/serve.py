"""The `serve` section's schema: `kiln serve`, the verifier as an HTTP service (docs/verifier.md, "The
verifier service"). The verifiers behind it are configured by the `verifier` section. Part of
`configs.schema.KilnConfig`; declared like every section there."""

from __future__ import annotations

from dataclasses import dataclass

from configs.fields import F


@dataclass
class ServeConfig:
    host: str = F("127.0.0.1", "Address the service binds; anything but loopback requires serve.token_file")
    port: int = F(8470, "TCP port the service listens on (0 = one the OS picks, printed at start)", ge=0, le=65535)
    token_file: str = F(
        "",
        "File of client tokens, one 'name token' pair a line ('#' comments): a request carries "
        "'Authorization: Bearer <token>', and its name is the client fair queueing serves in turn",
    )
    pool: str = F(
        "process",
        "Where the verifiers run: 'process' = in the service's process; 'ray' = as Ray actors on the cluster "
        "(cluster.address, or a local Ray), one GPU each on cuda, a dead one replaced",
        choices=["process", "ray"],
    )
    verifiers: int = F(1, "Verifier actors behind the service (each with its own sandboxes)", ge=1)
    tasks: str = F("tasks", "Task directory whose task ids a request may name instead of sending its reference")
    queue_capacity: int = F(256, "Jobs waiting for a verifier, all clients together; beyond it: 429", ge=1)
    client_share: int = F(64, "Jobs one client may have waiting; beyond it that client gets 429", ge=1)
    batch_max: int = F(100, "Candidates one batch request may carry", ge=1)
    deadline_s: float = F(900.0, "A request's deadline when it names none (seconds from its arrival)", gt=0.0)
    max_deadline_s: float = F(3600.0, "The longest deadline a request may ask for", gt=0.0)
    max_body_bytes: int = F(8 << 20, "Largest request body accepted (checked before it is parsed): 413", ge=1024)
    max_source_chars: int = F(256_000, "Largest candidate or reference source, in characters: 413", ge=1)
    keep_results_s: float = F(900.0, "How long an ended job's result can still be fetched by its id", gt=0.0)
    retry_after_s: int = F(5, "Retry-After (seconds) sent with a 429", ge=1)
