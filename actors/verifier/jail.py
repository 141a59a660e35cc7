"""Kernel-enforced confinement of every process that runs candidate code (or compiles it).

A candidate is untrusted, and so is every process that runs its code: module import, the compile
stage's capture, `__init__`, forward, destructors, the compilers it drives. `enter(spec)` is called
first thing in a process forked from the zygote and puts it behind these layers (Linux; the system
calls go through kiln_native, the sandbox's native module, never ctypes, which no process that runs
candidate code ever loads):

    layer      what it stops
    pid        its own PID namespace, the sandbox is PID 1: it cannot see, signal or ptrace the
               verifier or any other process, and every process it starts dies with it
    user       an unprivileged uid of its own (or a user namespace when the verifier is not root):
               host files owned by anyone else are not writable, no capabilities are left
    fs         a new root: the host tree read-only, with the Kiln source tree, the verifier's caches
               and run directories, home directories, /tmp, /var, /run and most of /etc hidden;
               one scratch directory is writable; /dev holds only null/zero/urandom (+ /dev/nvidia*).
               What is the sandbox's own (its scratch, its own built libraries) appears at neutral
               paths under /sandbox (`JailSpec.workdir`, `JailSpec.mounts`), so no path it sees names
               a host directory or another candidate
    uts        its own hostname ("sandbox"): the host's name is not the candidate's to read
    proc       a /proc of its own (its own processes only), /proc/1/mem masked
    net        an empty network namespace: no interface is up, nothing can be reached
    ipc        its own System V IPC / POSIX message queues
    nproc      RLIMIT_NPROC on its private uid: a bounded number of processes and threads
    seccomp    no ptrace, process_vm_*, mount, namespaces, kernel modules, bpf, perf, keyrings,
               io_uring, pidfd_getfd; no execve or personality where no program must run (execution,
               capture);
               only AF_UNIX sockets; no_new_privs
    files      core dumps off, file size and open-file limits
    fence      (processes that load candidate code, reported by them) armed before the first byte of
               candidate code: ATen compute refuses until the process exits, and so do Python's
               routes to raw memory and other code's frames (fence.py)

The process is forked in two steps: the first child creates the namespaces and forks the sandbox
(PID 1 of the new PID namespace), then stays as its *warden*: it waits, dies with the zygote
(PDEATHSIG, armed by the zygote's child before anything else: `die_with_parent`), takes the sandbox
with it (the sandbox has PDEATHSIG on the warden, set again after it changes uid, which clears it; a
warden that died in between is seen through a pipe only it holds) and exits with the sandbox's
status. Where no PID namespace can be made there is no warden: the process itself is the sandbox,
and it sets PDEATHSIG on the zygote again after its uid change (a zygote that died in between
shows in getppid()). A layer that cannot be applied on this machine is reported by name in
`JailReport.missing`, which the verifier prints at start-up and puts in every verdict's
diagnostics: confinement never weakens silently.
"""

from __future__ import annotations

import errno
import os
import platform
import resource
import select
import signal
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

from actors.verifier.seccomp import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    SYSCALLS_X86_64,
    seccomp_program,
)

LAYERS = ("pid", "user", "fs", "proc", "net", "ipc", "uts", "nproc", "seccomp", "files", "fence")
# Where what is a sandbox's own appears inside it: neutral paths that name no host directory, job or
# other candidate (its scratch, and the directory of its own built libraries).
NEUTRAL_ROOT = "/sandbox"
WORKDIR = NEUTRAL_ROOT + "/work"
LIBDIR = NEUTRAL_ROOT + "/lib"
HOSTNAME = "sandbox"  # the UTS namespace's name, in place of the host's


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 4, 38, 22
SECCOMP_MODE_FILTER = 2

# A uid of its own per sandbox (when the verifier runs as root): RLIMIT_NPROC then bounds exactly
# that sandbox's processes, and no host file belongs to it.
SANDBOX_UID_BASE = 1_600_000_000
SANDBOX_UID_SPAN = 1 << 16

# /etc entries a process needs to load libraries and run compilers; the rest of /etc (passwd,
# hostname, hosts, ssh, ...) is hidden, so it cannot be quoted back into the feedback.
ETC_VISIBLE = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")
# Top-level host directories a sandbox sees (read-only): the operating system, compilers and
# installed software. Every other top-level entry (/home, /root, /tmp, /var, /run, /mnt, /srv, work
# directories, ...) is hidden unless a path the sandbox needs (sys.path, the toolchain) lies in it.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/etc")
DEV_NODES = ("null", "zero", "full", "random", "urandom")


@dataclass(frozen=True)
class JailSpec:
    """What one sandboxed process may see and do."""

    scratch: str  # the only writable directory: cwd, HOME and TMPDIR
    hidden: tuple[str, ...] = ()  # host paths hidden even inside SYSTEM_DIRS (the Kiln tree, caches)
    visible: tuple[str, ...] = ()  # paths re-exposed read-only inside hidden areas (sys.path, artifacts)
    cuda: bool = False  # expose /dev/nvidia*
    exec_allowed: bool = False  # the process may run programs (compilers); never where candidate code runs
    # The process may write files (its scratch, a /dev/shm): never where candidate code runs, so no file
    # exists that it could map shared and read from Python. Its scratch is read-only then.
    writable: bool = True
    uid: int | None = None  # the sandbox's own uid when the verifier is root
    nproc: int = 256  # processes + threads of that uid
    file_size_mb: int = 2048  # largest file the sandbox may write
    env: tuple[tuple[str, str], ...] = ()  # the complete environment (HOME/TMPDIR are set to scratch)
    workdir: str = ""  # where the scratch appears inside (a neutral path); "" = at its host path
    mounts: tuple[tuple[str, str], ...] = ()  # (host directory, neutral path inside), bound read-only

    def inside(self, report: JailReport | None = None) -> str:
        """The scratch as the sandbox sees it: its neutral path when the `fs` layer holds (`report`
        None: as planned), else its host path (no mount namespace, no new root)."""
        fs = report is None or "fs" not in report.missing
        return self.workdir if self.workdir and fs else self.scratch

    def seen_at(self, host: str, report: JailReport | dict | None = None) -> str:
        """Where host directory `host` (one of `mounts`) appears inside the sandbox: its neutral path
        when the `fs` layer holds, else the host path itself."""
        missing = report.get("missing", {}) if isinstance(report, dict) else (report.missing if report else {})
        if "fs" not in (missing or {}):
            for src, dst in self.mounts:
                if src == host:
                    return dst
        return host

    def to_json(self) -> dict:
        return {
            "scratch": self.scratch,
            "hidden": list(self.hidden),
            "visible": list(self.visible),
            "cuda": self.cuda,
            "exec_allowed": self.exec_allowed,
            "writable": self.writable,
            "uid": self.uid,
            "nproc": self.nproc,
            "file_size_mb": self.file_size_mb,
            "env": [list(kv) for kv in self.env],
            "workdir": self.workdir,
            "mounts": [list(m) for m in self.mounts],
        }

    @staticmethod
    def from_json(d: dict) -> JailSpec:
        return JailSpec(
            scratch=str(d["scratch"]),
            hidden=tuple(map(str, d.get("hidden", ()))),
            visible=tuple(map(str, d.get("visible", ()))),
            cuda=bool(d.get("cuda")),
            exec_allowed=bool(d.get("exec_allowed")),
            writable=bool(d.get("writable", True)),
            uid=d.get("uid"),
            nproc=int(d.get("nproc", 256)),
            file_size_mb=int(d.get("file_size_mb", 2048)),
            env=tuple((str(k), str(v)) for k, v in d.get("env", ())),
            workdir=str(d.get("workdir") or ""),
            mounts=tuple((str(a), str(b)) for a, b in d.get("mounts", ())),
        )


@dataclass
class JailReport:
    """Which layers hold in this process, and why the others do not."""

    active: list[str] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)  # layer -> reason

    def ok(self, layer: str) -> None:
        if layer not in self.missing and layer not in self.active:
            self.active.append(layer)

    def fail(self, layer: str, reason: str) -> None:
        self.missing.setdefault(layer, reason)
        if layer in self.active:
            self.active.remove(layer)

    def to_json(self) -> dict:
        return {"active": list(self.active), "missing": dict(self.missing)}

    def notes(self) -> list[str]:
        return [f"sandbox layer '{k}' unavailable: {v}" for k, v in self.missing.items()]


class JailError(OSError):
    """A step of the set-up failed; the layer it belongs to is reported missing."""


def _native():
    from actors.verifier.native import loaded

    return loaded()


def _os_call(what: str, fn, *args):
    """Call a kiln_native system-call wrapper; its OSError becomes a JailError naming `what`."""
    try:
        return fn(*args)
    except OSError as err:
        raise JailError(err.errno or errno.EPERM, f"{what}: {os.strerror(err.errno or errno.EPERM)}") from None


def _syscall(name: str, *args) -> int:
    if platform.machine() != "x86_64":
        raise JailError(errno.ENOSYS, f"{name}: syscall numbers are known for x86_64 only")
    return _os_call(name, _native().syscall, SYSCALLS_X86_64[name], *args)


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _os_call(f"mount {src or fstype} on {dst}", _native().mount, src, dst, fstype, flags, data)


def _prctl(option: int, arg: int = 0) -> None:
    _os_call(f"prctl({option})", _native().prctl, option, arg)


# ---------------------------------------------------------------------------------- the warden


def enter(spec: JailSpec, report_pid) -> JailReport:
    """Confine the calling process (freshly forked, single-threaded). Returns in the sandbox process
    only; the warden calls `report_pid(sandbox pid in the caller's namespace)` and never returns."""
    report = JailReport()
    root = os.geteuid() == 0
    parent = os.getppid()  # the zygote (die_with_parent checked it): the fallback below watches it
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if not root:
        try:
            _enter_user_namespace()
            report.ok("user")
        except JailError as err:
            if err.filename is None and "unshare" in str(err):  # no user namespaces here: layer missing
                report.fail("user", str(err))
            else:
                raise
    try:
        _os_call("unshare", _native().unshare, flags)
    except JailError as err:
        for layer in ("pid", "fs", "proc", "net", "ipc", "uts"):
            report.fail(layer, str(err))
        report_pid(os.getpid())
        _confine_process(spec, report, root, mounts=False, warden_alive=None, parent=parent)
        return report
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the warden dies with the zygote
    _set_hostname(report)
    alive_r, alive_w = os.pipe()  # only the warden holds the write end: EOF here means it is gone
    pid = os.fork()
    if pid:
        os.close(alive_r)
        _warden(pid, report_pid)  # never returns
    os.close(alive_w)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the sandbox dies with its warden
    for layer in ("pid", "net", "ipc"):
        report.ok(layer)
    _confine_process(spec, report, root, mounts=True, warden_alive=alive_r, parent=None)
    return report


def _set_hostname(report: JailReport) -> None:
    """The new UTS namespace starts with the host's name: replace it (and the NIS domain) before the
    identity is dropped, so neither `socket.gethostname()`, `os.uname()` nor /proc/sys/kernel/hostname
    shows the host's name inside."""
    try:
        name = HOSTNAME.encode()
        _syscall("sethostname", name, len(name))
        _syscall("setdomainname", b"(none)", 6)
        report.ok("uts")
    except JailError as err:
        report.fail("uts", str(err))


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` (the thread that forked it) dies; exit now if it died
    already. Armed first thing after a fork: the parent may have died before the prctl, and then
    no signal ever comes (this process has been reparented: getppid() tells)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(70)


def _warden(pid: int, report_pid) -> None:
    code = 70
    try:
        report_pid(pid)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig not in (signal.SIGKILL, signal.SIGSTOP):  # no handler can be set for these (OSError)
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)  # the zygote sees the sandbox's own signal (the OOM killer's SIGKILL too)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 70
    finally:
        os._exit(code)


def _enter_user_namespace() -> None:
    """A user namespace in which this process is uid 0, mapped to the user it runs as. Once in it,
    a failure to write the maps leaves a process that can create no file: that is fatal (JailError
    from here propagates, and the sandbox does not start), not a missing layer."""
    uid, gid = os.geteuid(), os.getegid()
    _prctl(PR_SET_DUMPABLE, 1)  # /proc/self/*_map belong to root in a non-dumpable process
    _os_call("unshare(CLONE_NEWUSER)", _native().unshare, CLONE_NEWUSER)
    for path, text in (
        ("/proc/self/setgroups", "deny"),
        ("/proc/self/uid_map", f"0 {uid} 1"),
        ("/proc/self/gid_map", f"0 {gid} 1"),
    ):
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as err:
            raise JailError(err.errno, f"writing {path}: {err.strerror}", path) from None


# ----------------------------------------------------------------------------- the sandbox


def _confine_process(
    spec: JailSpec, report: JailReport, root: bool, *, mounts: bool, warden_alive: int | None, parent: int | None
) -> None:
    scratch = Path(spec.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    if root and spec.uid is not None:
        os.chown(scratch, spec.uid, spec.uid)
    if mounts:
        try:
            _build_root(spec)
            report.ok("fs")
            report.ok("proc")
        except JailError as err:
            report.fail("fs", str(err))
            report.fail("proc", str(err))
    else:
        report.fail("fs", "no mount namespace: the sandbox sees its scratch and libraries at their host paths")
    os.chdir(spec.inside(report))
    _set_limits(spec, report, root)
    _drop_identity(spec, report, root)
    _rearm_parent_death(warden_alive, parent)
    _set_environment(spec, report)
    try:
        _prctl(PR_SET_DUMPABLE, 0)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _install_seccomp(spec)
        report.ok("seccomp")
    except JailError as err:
        report.fail("seccomp", str(err))


def _rearm_parent_death(warden_alive: int | None, parent: int | None) -> None:
    """Changing uid cleared the parent-death signal: set it again, then make sure the parent did not
    die in between, so the sandbox can never outlive it. Under a warden the sandbox is PID 1 of its
    namespace (getppid() is 0 there): the warden's pipe reads EOF once it is gone. Without a PID
    namespace (the fallback) the parent is the zygote, and getppid() changes when it dies."""
    if warden_alive is None and parent is None:
        return
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if warden_alive is None:
        if os.getppid() != parent:
            os._exit(70)
        return
    ready, _, _ = select.select([warden_alive], [], [], 0)
    os.close(warden_alive)
    if ready:
        os._exit(70)


def _set_limits(spec: JailSpec, report: JailReport, root: bool) -> None:
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        size = spec.file_size_mb << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), min(1024, hard)))
        report.ok("files")
    except (OSError, ValueError) as err:
        report.fail("files", str(err))
    if root and spec.uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (spec.nproc, spec.nproc))
        report.ok("nproc")
    else:  # RLIMIT_NPROC counts every process of the uid, and this uid is the user's own
        report.fail(
            "nproc",
            "no private uid (the verifier is not root): processes are bounded by the "
            "PID namespace and the verifier's watchdog only",
        )


def _drop_identity(spec: JailSpec, report: JailReport, root: bool) -> None:
    if root:
        if spec.uid is None:
            report.fail("user", "no sandbox uid given: the sandbox keeps root")
            return
        os.setgroups([])
        os.setresgid(spec.uid, spec.uid, spec.uid)
        os.setresuid(spec.uid, spec.uid, spec.uid)  # clears every capability
        report.ok("user")
        return
    # In a user namespace we are uid 0 with every capability of that namespace: drop them all.
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = bytes(24)  # two __user_cap_data_struct, all zero
    try:
        _native().syscall(126, header, data)
    except OSError as err:
        if "user" in report.active:
            report.fail("user", f"capset: {os.strerror(err.errno or errno.EPERM)}")


def _set_environment(spec: JailSpec, report: JailReport) -> None:
    env = dict(spec.env)
    env.update(HOME=spec.inside(report), TMPDIR=spec.inside(report))
    os.environ.clear()
    os.environ.update(env)


# ------------------------------------------------------------------------------ filesystem


def _build_root(spec: JailSpec) -> None:
    """A fresh root (tmpfs) holding read-only binds of the host tree minus the hidden paths, a
    private /dev and /proc, and the writable scratch; then pivot_root into it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    new = f"{spec.scratch.rstrip('/')}.root"
    os.makedirs(new, exist_ok=True)
    _mount("kiln-root", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=755")
    special = {"/proc", "/dev", "/sys"}
    tops = ["/" + n for n in sorted(os.listdir("/"))]
    others = tuple(p for p in tops if p not in SYSTEM_DIRS and p not in special)
    mounted = tuple(host for host, _ in spec.mounts)  # seen at their neutral paths only
    hidden = _real_set(others + ("/etc",) + spec.hidden + (spec.scratch, new) + mounted)
    visible = _real_set(spec.visible + tuple(f"/etc/{n}" for n in ETC_VISIBLE))
    for path in tops:
        if path not in special:
            _expose(path, new, hidden, visible)
    _bind(new, "/sys", readonly=True)
    _make_dev(new, spec.cuda, shm=spec.writable)
    os.makedirs(new + "/proc", exist_ok=True)
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _bind(new, spec.scratch, readonly=not spec.writable, at=spec.workdir or None)
    for host, inside in spec.mounts:
        _bind(new, host, readonly=True, at=inside)
    os.makedirs(new + "/tmp", exist_ok=True)
    os.makedirs(new + "/.old", exist_ok=True)
    _syscall("pivot_root", new.encode(), (new + "/.old").encode())
    os.chdir("/")
    _os_call("umount old root", _native().umount2, "/.old", MNT_DETACH)
    os.rmdir("/.old")
    # /proc/1/mem is this process's memory: a write through it would patch the gate in place.
    _mount("/dev/null", "/proc/1/mem", None, MS_BIND)
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _real_set(paths) -> tuple[str, ...]:
    out = []
    for p in paths:
        if p:
            real = os.path.realpath(p)
            out.append(real.rstrip("/") or "/")
    return tuple(sorted(set(out)))


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _expose(path: str, new: str, hidden: tuple[str, ...], visible: tuple[str, ...]) -> None:
    """Mirror host `path` into the new root. The most specific rule decides (a visible path inside a
    hidden one is shown, a hidden path inside a visible one is not); a directory with rules below it
    is recreated and walked, any other shown path is bound read-only as a whole."""
    if os.path.islink(path):
        if _shown(path, hidden, visible):
            os.symlink(os.readlink(path), new + path)
        return
    shown = _shown(path, hidden, visible)
    inner = [r for r in hidden + visible if r != path and _under(r, path)]
    if not inner or not os.path.isdir(path):
        if shown:
            _bind(new, path, readonly=True)
        return
    os.makedirs(new + path, exist_ok=True)
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return
    for name in names:
        child = f"{path.rstrip('/')}/{name}"
        if shown or any(_under(r, child) for r in inner):
            _expose(child, new, hidden, visible)


def _shown(path: str, hidden: tuple[str, ...], visible: tuple[str, ...]) -> bool:
    """The longest rule above (or at) `path` decides; no rule means shown."""
    best, shown = -1, True
    for rules, verdict in ((hidden, False), (visible, True)):
        for r in rules:
            if _under(path, r) and len(r) > best:
                best, shown = len(r), verdict
    return shown


def _bind(new: str, path: str, *, readonly: bool, device: bool = False, at: str | None = None) -> None:
    """Bind host `path` read-only (or not) into the new root, at its own path or at `at`."""
    target = new + (at or path)
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            open(target, "w").close()
    _mount(path, target, None, MS_BIND | MS_REC)
    flags = MS_NOSUID | (0 if device else MS_NODEV) | (MS_RDONLY if readonly else 0)
    if not _setattr_recursive(target, flags):
        for mnt in _mounts_under(target):
            _mount(None, mnt, None, MS_REMOUNT | MS_BIND | flags)


def _setattr_recursive(target: str, flags: int) -> bool:
    """mount_setattr(AT_RECURSIVE): read-only for every submount at once (Linux >= 5.12)."""
    attr = (0x1 if flags & MS_RDONLY else 0) | 0x2 | (0x4 if flags & MS_NODEV else 0)  # RDONLY|NOSUID|NODEV
    buf = struct.pack("=QQQQ", attr, 0, 0, 0)
    AT_RECURSIVE, AT_FDCWD = 0x8000, -100
    try:
        return _syscall("mount_setattr", AT_FDCWD, target.encode(), AT_RECURSIVE, buf, len(buf)) == 0
    except JailError:
        return False


def _mounts_under(target: str) -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = line.split()[4].replace("\\040", " ")
            if _under(mnt, target):
                out.append(mnt)
    return out


def _make_dev(new: str, cuda: bool, *, shm: bool) -> None:
    dev = new + "/dev"
    os.makedirs(dev, exist_ok=True)
    _mount("kiln-dev", dev, "tmpfs", MS_NOSUID, "size=64k,mode=755")
    nodes = list(DEV_NODES)
    if cuda:
        nodes += sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
    for name in nodes:
        src = "/dev/" + name
        if os.path.exists(src):
            _bind(new, src, readonly=False, device=True)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{dev}/{name}")
    if shm:
        os.makedirs(dev + "/shm", exist_ok=True)
        _mount("kiln-shm", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")


# --------------------------------------------------------------------------------- seccomp


def _install_seccomp(spec: JailSpec) -> None:
    if platform.machine() != "x86_64":
        raise JailError(errno.ENOSYS, f"no seccomp policy for {platform.machine()}")
    _os_call("seccomp", _native().seccomp, seccomp_program(spec.exec_allowed))


def sandbox_uid(sequence: int) -> int:
    return SANDBOX_UID_BASE + sequence % SANDBOX_UID_SPAN


def python_paths(exclude: tuple[str, ...]) -> tuple[str, ...]:
    """Directories this interpreter imports from (sys.path, prefixes), minus those inside `exclude`
    (the Kiln source tree): re-exposed read-only so lazy imports of torch & co. keep working."""
    out = []
    for p in [*sys.path, sys.prefix, sys.base_prefix, sys.exec_prefix]:
        if not p:
            continue
        real = os.path.realpath(p)
        if not os.path.exists(real) or real == "/":
            continue
        if any(_under(real, e) and not _in_venv(real, e) for e in exclude):
            continue
        out.append(real)
    return tuple(sorted(set(out)))


def _in_venv(path: str, tree: str) -> bool:
    """A virtual environment (or other install) that lives inside the Kiln tree is not Kiln's source."""
    rel = os.path.relpath(path, tree).split(os.sep)
    return bool(rel) and rel[0] not in ("actors", "protocols", "configs", "launch", "tasks", "tests", "docs", ".")
