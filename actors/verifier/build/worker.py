"""The build process: compiles one extension in a jail (`python` forked by the zygote, kind "build").

The compilers read the candidate's C++/CUDA, so they run like candidate code does: jailed
(jail.py), as an unprivileged uid, with a read-only view of the toolchain, the precompiled headers
and the binding-object cache, and one writable build directory. Flags that load code into the
compiler or the linker (`-fplugin`, `-wrapper`, `-B`, `-specs`) were refused when the call was read
(spec.py); whatever a compiler still does, it can touch nothing but this directory.

Protocol on its socket (wire.py): one request {spec, toolchain, pch_dir, cache_dir, prelude_policy},
one reply: {ok, so (file name in the build dir), prelude, phases, vendor_libs, notes, pch_wanted,
binding: [key, object file] | None} or {ok: False, message, infra, unit, phases}.
"""

from __future__ import annotations

import socket
import traceback
from pathlib import Path

from actors.verifier import isolation, wire

from .cache import ArtifactCache
from .compiler import CompileFailed, ExtensionBuilder
from .preludes import PchStore
from .spec import ExtensionSpec
from .toolchain import Toolchain


def build(request: dict, build_dir: Path) -> dict:
    toolchain = Toolchain.from_dict(request["toolchain"])
    cache = ArtifactCache(Path(request["cache_dir"]), toolchain.digest, create=False)
    pch = PchStore(Path(request["pch_dir"]), toolchain, create=False)
    builder = ExtensionBuilder(toolchain, cache, pch, request.get("prelude_policy", "auto"))
    spec = ExtensionSpec.from_dict(request["spec"])
    try:
        built = builder.compile(spec, build_dir)
    except CompileFailed as e:
        return {"ok": False, "message": e.message, "infra": e.infra, "unit": e.unit, "phases": e.phases}
    return {
        "ok": True,
        "so": Path(built.so_path).name,
        "prelude": built.prelude,
        "phases": built.phases,
        "vendor_libs": built.vendor_libs,
        "notes": built.notes,
        "pch_wanted": [[p, list(prof)] for p, prof in built.pch_wanted],
        "binding": list(built.binding) if built.binding else None,
    }


def child_main(fds: list[int], spec, report, args: dict) -> int:
    """Entry point in the jailed build process (called by the zygote)."""
    isolation.hide_kiln_modules()
    sock = socket.socket(fileno=fds[0])
    try:
        request = wire.recv(sock)
        try:
            reply = build(request, Path(spec.scratch))
        except Exception as e:  # noqa: BLE001 - a bug or an unusable machine: infra, with the reason
            reply = {
                "ok": False,
                "infra": True,
                "unit": "builder",
                "phases": {},
                "message": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}",
            }
        reply["jail"] = report.to_json()
        wire.send(sock, reply)
        return 0
    except wire.WireError:
        return 3
