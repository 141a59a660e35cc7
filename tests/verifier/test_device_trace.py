"""The cuda sandbox's device trace (native/kiln_trace.h, device_trace.py), on this machine without a GPU.

kiln_trace reads CUPTI's activity records at fixed offsets. Here a stand-in CUPTI, compiled against
the CUDA toolkit's own `cupti_activity.h`, writes records with the real structs of that release
(CUpti_ActivityKernel10, CUpti_ActivityMemcpy6, CUpti_ActivityMemset4) and hands them over as CUPTI
does (buffers requested, completed at a flush). So the offsets are checked against the header, not
against themselves. What this cannot check: that a real device writes what its header says (the GPU
runs in docs/BENCHMARKS.md do: the shipped solutions' own kernels and the sandbox's copies on the record).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.verifier import device_trace, native
from actors.verifier.provenance import Traced, judge_cuda

CUPTI_INCLUDE = next(
    (
        p
        for p in (
            Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include",
            Path("/usr/local/cuda-13.0/include"),
        )
        if (p / "cupti_activity.h").is_file()
    ),
    None,
)

FAKE_CUPTI = r"""
#include <cupti_activity.h>
#include <cupti_version.h>
#include <stdlib.h>
#include <string.h>

static CUpti_BuffersCallbackRequestFunc requested;
static CUpti_BuffersCallbackCompleteFunc completed;
static int enabled[64];
static uint8_t *held[64];
static size_t held_size[64], held_valid[64];
static int nheld;
static uint64_t clock_ns = 1000;

CUptiResult cuptiGetVersion(uint32_t *v) { *v = CUPTI_API_VERSION; return CUPTI_SUCCESS; }
CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc r, CUpti_BuffersCallbackCompleteFunc c) {
    requested = r, completed = c;
    return CUPTI_SUCCESS;
}
CUptiResult cuptiActivityEnable(CUpti_ActivityKind k) { enabled[k] = 1; return CUPTI_SUCCESS; }
CUptiResult cuptiActivityDisable(CUpti_ActivityKind k) { enabled[k] = 0; return CUPTI_SUCCESS; }
int fake_enabled(void) { int n = 0; for (int i = 0; i < 64; i++) n += enabled[i]; return n; }

static uint8_t *room(size_t need) {  /* the current buffer, or a new one requested as CUPTI does */
    if (nheld == 0 || held_valid[nheld - 1] + need > held_size[nheld - 1]) {
        size_t size = 0, most = 0;
        uint8_t *b = NULL;
        requested(&b, &size, &most);
        if (b == NULL || size < need) return NULL;
        held[nheld] = b, held_size[nheld] = size, held_valid[nheld] = 0, nheld++;
    }
    uint8_t *at = held[nheld - 1] + held_valid[nheld - 1];
    held_valid[nheld - 1] += need;
    return at;
}

/* The device runs `kernels` launches of kernel `name`, then one device-to-device copy and one memset. */
void fake_run(const char *name, int kernels) {
    static char names[8][256];
    static int nnames;
    char *kept = names[nnames++ % 8];
    strncpy(kept, name, 255);
    for (int i = 0; i < kernels && enabled[CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL]; i++) {
        CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)room(sizeof *k);
        if (k == NULL) return;
        memset(k, 0, sizeof *k);
        k->kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
        k->start = clock_ns, k->end = clock_ns + 500, k->streamId = 7, k->name = kept;
        clock_ns += 1000;
    }
    if (enabled[CUPTI_ACTIVITY_KIND_MEMCPY]) {
        CUpti_ActivityMemcpy6 *c = (CUpti_ActivityMemcpy6 *)room(sizeof *c);
        if (c == NULL) return;
        memset(c, 0, sizeof *c);
        c->kind = CUPTI_ACTIVITY_KIND_MEMCPY, c->copyKind = CUPTI_ACTIVITY_MEMCPY_KIND_DTOD;
        c->start = clock_ns, c->end = clock_ns + 200, c->streamId = 9;
        clock_ns += 1000;
    }
    if (enabled[CUPTI_ACTIVITY_KIND_MEMSET]) {
        CUpti_ActivityMemset4 *s = (CUpti_ActivityMemset4 *)room(sizeof *s);
        if (s == NULL) return;
        memset(s, 0, sizeof *s);
        s->kind = CUPTI_ACTIVITY_KIND_MEMSET, s->start = clock_ns, s->end = clock_ns + 100, s->streamId = 9;
        clock_ns += 1000;
    }
}

/* Asks for `n` more buffers than it fills: the trace's pool runs out. */
void fake_starve(int n) {
    for (int i = 0; i < n; i++) {
        size_t size = 0, most = 0;
        uint8_t *b = NULL;
        requested(&b, &size, &most);
        if (b != NULL) held[nheld] = b, held_size[nheld] = size, held_valid[nheld] = 0, nheld++;
    }
}

CUptiResult cuptiActivityFlushAll(uint32_t flag) {
    for (int i = 0; i < nheld; i++) completed(NULL, 0, held[i], held_size[i], held_valid[i]);
    nheld = 0;
    return CUPTI_SUCCESS;
}

static size_t record_size(const CUpti_Activity *r) {
    switch (r->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: return sizeof(CUpti_ActivityKernel10);
    case CUPTI_ACTIVITY_KIND_MEMCPY: return sizeof(CUpti_ActivityMemcpy6);
    case CUPTI_ACTIVITY_KIND_MEMSET: return sizeof(CUpti_ActivityMemset4);
    default: return 0;
    }
}

CUptiResult cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, CUpti_Activity **record) {
    size_t at = *record == NULL ? 0 : (size_t)((uint8_t *)*record - buffer) + record_size(*record);
    if (at >= valid) return CUPTI_ERROR_MAX_LIMIT_REACHED;
    *record = (CUpti_Activity *)(buffer + at);
    return CUPTI_SUCCESS;
}
"""

CHILD = r"""
import ctypes, json, sys
from actors.verifier import native
kn = native.load(native.NATIVE, sys.argv[1])
out = {}
try:
    kn.trace_start()
except RuntimeError as err:
    out["unattached"] = str(err)
for path in ("/nonexistent/libcupti.so.13", "libc.so.6"):
    try:
        kn.trace_attach(path)
    except RuntimeError as err:
        out.setdefault("refused", []).append(str(err))
fake = ctypes.CDLL(sys.argv[2])
kn.trace_attach(sys.argv[2])
fake.fake_run(b"_Z9my_kernelPf", 3)  # before any start: nothing is enabled, nothing recorded
kn.trace_start()
out["enabled_while_tracing"] = fake.fake_enabled()
fake.fake_run(b"_Z9my_kernelPf", 3)
fake.fake_run(b"_ZN2at6native4fillEv", 1)
records, lost = kn.trace_stop()
out["enabled_after"] = fake.fake_enabled()
out["records"], out["lost"] = records, lost
kn.trace_start()
fake.fake_starve(17)
out["starved"] = kn.trace_stop()[1]
kn.trace_start()
fake.fake_run(b"_Z9my_kernelPf", 1)
out["after_starving"] = len(kn.trace_stop()[0])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def traced_child(tmp_path_factory) -> dict:
    if CUPTI_INCLUDE is None:
        pytest.skip("the CUDA toolkit's cupti_activity.h is not installed")
    d = tmp_path_factory.mktemp("trace")
    kn = d / native.filename(native.NATIVE)
    subprocess.run(native.native_command(kn), check=True, capture_output=True, timeout=120)
    (d / "fake_cupti.c").write_text(FAKE_CUPTI)
    fake = d / "libfakecupti.so"
    subprocess.run(
        [
            native.c_compiler(),
            "-O1",
            "-shared",
            "-fPIC",
            f"-I{CUPTI_INCLUDE}",
            str(d / "fake_cupti.c"),
            "-o",
            str(fake),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(kn), str(fake)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_the_trace_reads_each_record_where_cuptis_header_puts_it(traced_child):
    """Kernels (mangled name, times, stream), copies by kind and memsets, as the toolkit's structs lay
    them out. Reopened by: a wrong offset in kiln_trace.h (the name at 96 instead of 104 reads the
    grid id as a pointer; the memcpy's stream at 48 reads past it)."""
    got = [tuple(r) for r in traced_child["records"]]
    kernel = [r for r in got if r[0] == "kernel"]
    assert [r[1] for r in kernel] == ["_Z9my_kernelPf"] * 3 + ["_ZN2at6native4fillEv"]
    assert all(r[3] - r[2] == 500 and r[4] == 7 for r in kernel)
    assert [(r[1], r[3] - r[2], r[4]) for r in got if r[0] == "memcpy"] == [("Memcpy DtoD", 200, 9)] * 2
    assert [(r[1], r[3] - r[2], r[4]) for r in got if r[0] == "memset"] == [("Memset", 100, 9)] * 2
    assert traced_child["lost"] == 0


def test_the_trace_is_on_only_between_start_and_stop(traced_child):
    """What ran before `trace_start` is not recorded, and `trace_stop` leaves no record kind enabled,
    so a timed call (never traced) pays nothing for the trace. Reopened by: enabling at attach, or a
    stop that flushes without disabling (torch's profiler stays subscribed once started)."""
    assert traced_child["enabled_while_tracing"] == 3
    assert traced_child["enabled_after"] == 0
    assert len(traced_child["records"]) == 8  # the run before the start left nothing


def test_a_trace_that_runs_out_of_buffers_says_it_lost_records(traced_child):
    """Reopened by: handing CUPTI no buffer without counting it (a flood of launches would then hide
    the rest of a call's kernels); the next trace is whole again."""
    assert traced_child["starved"] >= 1
    assert traced_child["after_starving"] == 3


def test_the_trace_refuses_to_run_unattached_or_on_a_library_that_is_not_cupti(traced_child):
    assert "not attached" in traced_child["unattached"]
    missing, libc = traced_child["refused"]
    assert "did not load" in missing and "lacks CUPTI's activity API" in libc


def test_lost_records_make_the_trace_incomplete():
    """A trace with lost records is judged as one that recorded nothing: mutation `lost` ignored in
    judge_cuda passes a call whose aten kernels were lost to the record."""
    own = frozenset({"k(float*)"})
    whole = [Traced("call", 1, [["k(float*)", 1]])]
    assert not judge_cuda(whole, own, 0, True).findings
    flooded = [Traced("call", 1, [["k(float*)", 1]], lost=3)]
    assert [v.kind for v in judge_cuda(flooded, own, 0, True).findings] == ["trace_missing"]


def test_cupti_is_found_beside_torchs_cuda_libraries_for_its_major_version(tmp_path, monkeypatch):
    """The nvidia wheels' copy matching torch's CUDA major first, then any; the toolkit's after them;
    and a one-line error where there is none (the sandbox's preparation then fails as the system's)."""
    for rel in ("nvidia/cu12/lib/libcupti.so.12", "nvidia/cu13/lib/libcupti.so.13"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.setattr(device_trace, "_mapped", lambda: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    assert device_trace.cupti_library("13.0") == str(tmp_path / "nvidia/cu13/lib/libcupti.so.13")
    assert device_trace.cupti_library("12.8") == str(tmp_path / "nvidia/cu12/lib/libcupti.so.12")
    monkeypatch.setattr(sys, "path", [])
    assert device_trace.cupti_library("13.0") is None
    with pytest.raises(RuntimeError, match="CUPTI") as err:
        device_trace.attach(None, "13.0")
    assert "\n" not in str(err.value)
