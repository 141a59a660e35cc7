"""The seccomp filters of the jail (x86_64): system-call numbers, what is denied, and the classic-BPF
programs that enforce it.

`seccomp_program` is the filter every jailed process installs (jail.py): the listed calls fail with
EPERM, namespace flags in clone, sockets other than AF_UNIX, x32 and foreign-architecture calls are
refused, and programs may run only where a compiler must (`exec_allowed`). `armed_seccomp_program`
is stacked on top of it when a process that loads candidate code seals (fence.py): no signal
handlers, timers or new processes from then on. Pure data and byte packing: nothing here acts on
the process that builds a filter.
"""

from __future__ import annotations

import errno
import struct

# The namespace flags of clone/unshare: the jail creates namespaces with them, the filter refuses them.
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080
NS_FLAGS = (
    CLONE_NEWNS
    | CLONE_NEWCGROUP
    | CLONE_NEWUTS
    | CLONE_NEWIPC
    | CLONE_NEWUSER
    | CLONE_NEWPID
    | CLONE_NEWNET
    | CLONE_NEWTIME
)

# System-call numbers on x86_64, of every call the filters name.
SYSCALLS_X86_64 = {
    "pivot_root": 155,
    "mount_setattr": 442,
    # denied everywhere
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "keyctl": 250,
    "add_key": 248,
    "request_key": 249,
    "mount": 165,
    "umount2": 166,
    "unshare": 272,
    "setns": 308,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "acct": 163,
    "settimeofday": 164,
    "clock_settime": 227,
    "clock_adjtime": 305,
    "adjtimex": 159,
    "syslog": 103,
    "open_by_handle_at": 304,
    "name_to_handle_at": 303,
    "quotactl": 179,
    "iopl": 172,
    "ioperm": 173,
    "vhangup": 153,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "open_tree": 428,
    "move_mount": 429,
    "chroot": 161,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "kcmp": 312,
    "lookup_dcookie": 212,
    "fanotify_init": 300,
    "mknod": 133,
    "mknodat": 259,
    "personality": 135,
    "clone3": 435,
    "sethostname": 170,
    "setdomainname": 171,
    # conditional
    "execve": 59,
    "execveat": 322,
    "clone": 56,
    "socket": 41,
}
_DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "mount",
    "umount2",
    "unshare",
    "setns",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "syslog",
    "open_by_handle_at",
    "name_to_handle_at",
    "quotactl",
    "iopl",
    "ioperm",
    "vhangup",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "open_tree",
    "move_mount",
    "chroot",
    "pidfd_getfd",
    "process_madvise",
    "kcmp",
    "lookup_dcookie",
    "fanotify_init",
    "mknod",
    "mknodat",
    "pivot_root",
    "mount_setattr",
    "sethostname",
    "setdomainname",
)
AUDIT_ARCH_X86_64 = 0xC000003E
AF_UNIX = 1


def seccomp_program(exec_allowed: bool) -> bytes:
    """A classic-BPF seccomp filter (x86_64): deny listed syscalls with EPERM, namespace flags in
    clone, non-AF_UNIX sockets, x32 and foreign-architecture calls; allow the rest."""
    # Compilers may run programs, and gcc turns address-space randomisation off (personality) to map a
    # precompiled header where it was built; candidate code needs neither.
    denied = list(_DENIED) + ([] if exec_allowed else ["execve", "execveat", "personality"])
    # Layout: [arch check][x32 check][clone3 -> ENOSYS][clone flags][socket domain][denied...] [ALLOW][DENY][NOSYS][KILL]
    body: list[tuple] = [
        ("ld", 4),
        ("jeq_else_kill", AUDIT_ARCH_X86_64),
        ("ld", 0),
        ("jge_deny", 0x40000000),
        ("jeq_nosys", SYSCALLS_X86_64["clone3"]),
        ("clone",),
        ("socket",),
    ]
    body += [("jeq_deny", SYSCALLS_X86_64[n]) for n in denied]
    return _assemble(body)


# What the kernel refuses from the moment a process that loads candidate code seals (fence.py), on
# top of the jail's filter: signal handlers and timers (a handler would run work after forward
# returned), new processes (threads stay allowed) and anonymous shared memory files.
_ARMED_DENIED = (
    "rt_sigaction",
    "alarm",
    "setitimer",
    "timer_create",
    "timer_settime",
    "timerfd_create",
    "timerfd_settime",
    "signalfd",
    "signalfd4",
    "memfd_create",
    "kill",
    "fork",
    "vfork",
)
SYSCALLS_X86_64.update(
    {
        "rt_sigaction": 13,
        "alarm": 37,
        "setitimer": 38,
        "timer_create": 222,
        "timer_settime": 223,
        "timerfd_create": 283,
        "timerfd_settime": 286,
        "signalfd": 282,
        "signalfd4": 289,
        "memfd_create": 319,
        "kill": 62,
        "fork": 57,
        "vfork": 58,
    }
)
CLONE_THREAD = 0x00010000


def armed_seccomp_program() -> bytes:
    """The filter a process stacks when it seals: _ARMED_DENIED, and clone without CLONE_THREAD."""
    body: list[tuple] = [("ld", 4), ("jeq_else_kill", AUDIT_ARCH_X86_64), ("ld", 0), ("thread_only",)]
    body += [("jeq_deny", SYSCALLS_X86_64[n]) for n in _ARMED_DENIED]
    return _assemble(body)


def _assemble(body: list[tuple]) -> bytes:
    """Classic-BPF instructions for the steps of a filter, with symbolic jumps to its four returns."""
    ld, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    deny = 0x00050000 | errno.EPERM
    nosys = 0x00050000 | errno.ENOSYS
    ins: list[list] = []
    for step in body:
        op = step[0]
        if op == "ld":
            ins.append([ld, None, None, step[1]])
        elif op == "jeq_else_kill":
            ins.append([jeq, 0, "KILL", step[1]])
        elif op == "jge_deny":
            ins.append([jge, "DENY", 0, step[1]])
        elif op == "jeq_nosys":
            ins.append([jeq, "NOSYS", 0, step[1]])
        elif op == "jeq_deny":
            ins.append([jeq, "DENY", 0, step[1]])
        elif op == "clone":  # if nr == clone: A = flags; deny if any namespace flag; reload nr
            ins += [
                [jeq, 0, 3, SYSCALLS_X86_64["clone"]],
                [ld, None, None, 16],
                [jset, "DENY", 0, NS_FLAGS],
                [ld, None, None, 0],
            ]
        elif op == "thread_only":  # if nr == clone: A = flags; deny unless CLONE_THREAD; reload nr
            ins += [
                [jeq, 0, 3, SYSCALLS_X86_64["clone"]],
                [ld, None, None, 16],
                [jset, 0, "DENY", CLONE_THREAD],
                [ld, None, None, 0],
            ]
        elif op == "socket":  # if nr == socket: A = domain; deny unless AF_UNIX; reload nr
            ins += [
                [jeq, 0, 3, SYSCALLS_X86_64["socket"]],
                [ld, None, None, 16],
                [jeq, 0, "DENY", AF_UNIX],
                [ld, None, None, 0],
            ]
    tail = {"ALLOW": len(ins), "DENY": len(ins) + 1, "NOSYS": len(ins) + 2, "KILL": len(ins) + 3}
    ins += [[ret, None, None, allow], [ret, None, None, deny], [ret, None, None, nosys], [ret, None, None, kill]]
    out = b""
    for i, (code, jt, jf, k) in enumerate(ins):

        def rel(t, i=i):
            if t is None:
                return 0
            off = tail[t] - i - 1 if isinstance(t, str) else t
            if not 0 <= off < 256:
                raise ValueError("seccomp jump out of range")
            return off

        out += struct.pack("=HBBI", code, rel(jt), rel(jf), k & 0xFFFFFFFF)
    return out
