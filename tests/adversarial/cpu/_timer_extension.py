import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

# One extension shared by the red team's timer-escape cases (cpu): an honest ReLU kernel plus three ways
# to run it after forward returned. Nothing here imports a forbidden symbol: the alarm is installed with
# inline `syscall` instructions, the worker is a plain std::thread started before any forward.
timer_source = r"""
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

static void relu_loop(const float* s, float* d, int64_t n) {
    for (int64_t i = 0; i < n; ++i) d[i] = s[i] > 0.0f ? s[i] : 0.0f;
}

// An honest kernel: y = relu(x), both contiguous float32 of the same size.
void relu_into(torch::Tensor x, torch::Tensor y) {
    relu_loop(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
}

// ---- a persistent worker thread, started once (before any forward), fed through a mailbox
static std::mutex g_mu;
static std::condition_variable g_cv;
static const float* g_src = nullptr;
static float* g_dst = nullptr;
static int64_t g_n = 0;
static int64_t g_delay_us = 0;
static bool g_started = false;

static void worker() {
    for (;;) {
        const float* s; float* d; int64_t n; int64_t delay_us;
        {
            std::unique_lock<std::mutex> lock(g_mu);
            g_cv.wait(lock, [] { return g_dst != nullptr; });
            s = g_src; d = g_dst; n = g_n; delay_us = g_delay_us;
            g_dst = nullptr;
        }
        if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        relu_loop(s, d, n);
    }
}

void worker_start() {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_started) { std::thread(worker).detach(); g_started = true; }
}

// Hands the job to the worker and returns at once; the worker starts on it after `delay_us`.
void worker_submit_after(torch::Tensor x, torch::Tensor y, int64_t delay_us) {
    {
        std::lock_guard<std::mutex> lock(g_mu);
        g_src = x.data_ptr<float>(); g_dst = y.data_ptr<float>(); g_n = x.numel(); g_delay_us = delay_us;
    }
    g_cv.notify_one();
}

void worker_submit(torch::Tensor x, torch::Tensor y) { worker_submit_after(x, y, 0); }

// ---- SIGALRM through raw syscalls (no sigaction/setitimer symbol is imported)
static long raw4(long nr, long a, long b, long c, long d) {
    long ret;
    register long r10 asm("r10") = d;
    asm volatile("syscall" : "=a"(ret) : "a"(nr), "D"(a), "S"(b), "d"(c), "r"(r10) : "rcx", "r11", "memory");
    return ret;
}
asm(".text\n.globl kiln_rt_restore\n.hidden kiln_rt_restore\n.type kiln_rt_restore,@function\n"
    "kiln_rt_restore:\n movq $15, %rax\n syscall\n");
extern "C" void kiln_rt_restore();

struct KSigaction { void (*handler)(int); unsigned long flags; void (*restorer)(); unsigned long mask; };
static std::atomic<const float*> a_src{nullptr};
static std::atomic<float*> a_dst{nullptr};
static std::atomic<int64_t> a_n{0};

static void on_alarm(int) {
    float* d = a_dst.exchange(nullptr);
    if (d) relu_loop(a_src.load(), d, a_n.load());
}

// Installs the handler (once) and arms a one-shot ITIMER_REAL of `usec` microseconds that finishes y.
int64_t alarm_finish(torch::Tensor x, torch::Tensor y, int64_t usec) {
    static bool installed = false;
    if (!installed) {
        KSigaction act{on_alarm, 0x04000000UL | 0x10000000UL, kiln_rt_restore, 0};  // SA_RESTORER | SA_RESTART
        long r = raw4(13 /* rt_sigaction */, 14 /* SIGALRM */, (long)&act, 0, 8);
        if (r != 0) return r;
        installed = true;
    }
    a_src.store(x.data_ptr<float>()); a_n.store(x.numel()); a_dst.store(y.data_ptr<float>());
    long timer[4] = {0, 0, 0, (long)usec};  // it_interval {0,0}, it_value {0, usec}
    return raw4(38 /* setitimer */, 0 /* ITIMER_REAL */, (long)timer, 0, 0);
}
"""

timer_ext = load_inline(
    name="kiln_redteam_timer_cpu",
    cpp_sources=timer_source,
    functions=["relu_into", "worker_start", "worker_submit", "worker_submit_after", "alarm_finish"],
    verbose=False,
    extra_cflags=["-O2"],
)
