"""The compute fence's native half: a small C++ library built once per toolchain by the trusted service.

It registers, for every operator and backend key the verifier names, a boxed kernel that refuses to
run while the fence's window is open (recording the op and raising) and otherwise calls the kernel it
replaced with the same boxed stack, untouched. Doing this in C++ (rather than a Python kernel)
keeps every argument exactly as the dispatcher passed it (a Python scalar in a tensor position stays
a wrapped number) and costs no Python call per op. The window flag is a C++ atomic that Python code
can only reach through the handle the sandbox holds (fence.py).

    int  kiln_fence_install(const char* const* ops, int n, const char* const* keys, int k)
         ops: "name.overload" (overload may be empty), keys: backend key names; returns kernels registered
    void kiln_fence_window(int open)
    void kiln_fence_evidence(int fd)          write end of the evidence pipe (-1: none)
    int  kiln_fence_take(char* buf, int len)  ops refused since the last call, one per line
"""

from __future__ import annotations

SOURCE = r"""// Kiln compute fence (actors/verifier/build/fence_lib.py)
#include <ATen/core/boxing/KernelFunction.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <unistd.h>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

std::atomic<int> g_open{0};
std::atomic<int> g_fd{-1};
std::mutex g_lock;
std::string g_taken;
std::vector<std::unique_ptr<torch::Library>> g_libraries;

struct FenceKernel final : c10::OperatorKernel {
  FenceKernel(c10::SafeKernelFunction original, std::string name)
      : original_(std::move(original)), name_(std::move(name)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    if (g_open.load(std::memory_order_relaxed)) {
      std::string line = "forbidden_op\taten::" + name_ + "\t\n";
      int fd = g_fd.load();
      if (fd >= 0) {
        ssize_t written = ::write(fd, line.data(), line.size());
        (void)written;
      }
      {
        std::lock_guard<std::mutex> guard(g_lock);
        if (g_taken.size() < 65536) g_taken += "aten::" + name_ + "\n";
      }
      TORCH_CHECK(false, "aten::", name_, " is not allowed inside forward: only tensor plumbing "
                  "(empty/view/reshape/contiguous/copy_) may run in PyTorch; compute in your own kernel");
    }
    original_.callBoxed(op, keys, stack);
  }

  c10::SafeKernelFunction original_;
  std::string name_;
};

// Overriding a kernel warns once ("Overriding a previously registered kernel"): expected here.
struct Quiet final : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

}  // namespace

extern "C" int kiln_fence_install(const char* const* ops, int n_ops, const char* const* keys, int n_keys) {
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", std::nullopt, __FILE__, __LINE__);
  int registered = 0;
  for (int i = 0; i < n_ops; ++i) {
    std::string full(ops[i]);
    auto dot = full.find('.');
    std::string name = dot == std::string::npos ? full : full.substr(0, dot);
    std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
    auto handle = c10::Dispatcher::singleton().findOp(c10::OperatorName("aten::" + name, overload));
    if (!handle) continue;
    for (int k = 0; k < n_keys; ++k) {
      c10::DispatchKey key = c10::parseDispatchKey(keys[k]);
      if (!handle->hasComputedKernelForDispatchKey(key)) continue;
      auto original = handle->getComputedKernelForDispatchKey(key);
      lib->impl(full.c_str(),
                torch::dispatch(key, torch::CppFunction::makeFromBoxedFunctor(
                                         std::make_unique<FenceKernel>(std::move(original), name))));
      ++registered;
    }
  }
  g_libraries.push_back(std::move(lib));
  return registered;
}

extern "C" void kiln_fence_window(int open) { g_open.store(open ? 1 : 0); }

extern "C" void kiln_fence_evidence(int fd) { g_fd.store(fd); }

extern "C" int kiln_fence_take(char* buf, int len) {
  std::lock_guard<std::mutex> guard(g_lock);
  int n = static_cast<int>(g_taken.size() < static_cast<size_t>(len) ? g_taken.size() : static_cast<size_t>(len));
  std::memcpy(buf, g_taken.data(), n);
  g_taken.clear();
  return n;
}
"""
