// kiln_fence: the compute fence, a Python extension module built once per toolchain by the trusted
// build service (actors/verifier/native/__init__.py) and imported by the zygote after torch.
//
// `install(ops, keys)` registers, for every named ATen operator and backend key, a boxed kernel in
// front of the one the dispatcher had. Until the process is armed (kiln_native.arm, one-way) the
// kernel calls the one it replaced with the same boxed stack, untouched; from then on, in every
// thread and until the process exits, it refuses: it writes the op to the evidence pipe (with the
// candidate's line when a Python frame of the candidate is on this thread's stack) and raises.
// There is no window and no switch back: the zygote (which never runs candidate code) installs the
// fence, and every process forked from it that loads candidate code arms it (kiln_native.arm_compute)
// before the first input enters it: the candidate's module and its ModelNew instances are built
// before that, when there is no input in the process to compute anything from.
// Doing this in C++ keeps every argument exactly as the dispatcher passed it and costs no Python
// call per op.
//
// It also holds the sandbox's own data movement (`plain`, `meta`, `empty`, `bytes_view`, `copy`):
// the plumbing the sandbox's code runs once candidate code exists, with every Python-level
// interception excluded (dispatch modes, the Python dispatcher, torch-function modes, functorch
// layers), so candidate code never sees a tensor of the sandbox's and cannot change what these do.
// They only do what the candidate may do anyway (allocate, view, copy), so the candidate reaching
// them gains nothing.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/core/boxing/KernelFunction.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <atomic>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

struct KilnNativeAPI {  // kiln_native.c's, field for field
  int (*armed)(void);
  void (*refused)(const char* kind, const char* what);
  int (*sealed)(void);
};

KilnNativeAPI* g_api = nullptr;
std::vector<std::unique_ptr<torch::Library>> g_libraries;
// Elements ATen's compute produced after the seal and before arming: the candidate's module and its
// ModelNew instances being built, before any input exists (`precomputed`). The verifier bounds it.
std::atomic<long long> g_precomputed{0};

long long elements(const torch::jit::Stack& stack) {
  long long n = 0;
  for (const auto& v : stack) {
    if (v.isTensor()) {
      n += v.toTensor().defined() ? v.toTensor().numel() : 0;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) n += t.defined() ? t.numel() : 0;
    }
  }
  return n;
}
// Set while the sandbox's own data movement runs on this thread (`copy`): its device-to-host copies
// of outputs are the point; the candidate's are a host round-trip.
thread_local bool t_sandbox_copy = false;

struct FenceKernel final : c10::OperatorKernel {
  FenceKernel(c10::SafeKernelFunction original, std::string name)
      : original_(std::move(original)), name_("aten::" + std::move(name)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    if (g_api->armed()) {
      g_api->refused("forbidden_op", name_.c_str());
      TORCH_CHECK(false, name_, " is not allowed in the verifier's sandbox: only tensor plumbing "
                  "(empty/view/reshape/contiguous/copy_) may run in PyTorch; compute in your own kernel");
    }
    original_.callBoxed(op, keys, stack);
    if (g_api->sealed()) g_precomputed += elements(*stack);  // the outputs, now on the stack
  }

  c10::SafeKernelFunction original_;
  std::string name_;
};

// In front of a copy's device kernel: once armed, a copy from the device into host memory made by
// the candidate's code (not the sandbox's own `copy`) refuses: the data would leave the GPU for the
// host, where the candidate's own host code could compute on it.
struct HostGuard final : c10::OperatorKernel {
  HostGuard(c10::SafeKernelFunction original, std::string name)
      : original_(std::move(original)), name_("aten::" + std::move(name)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    if (g_api->armed() && !t_sandbox_copy && leaves_device(*stack, dst_first_)) {
      g_api->refused("host_roundtrip", (name_ + " from the device to the host").c_str());
      TORCH_CHECK(false, name_, " from the device to the host is not allowed in the verifier's sandbox: compute on "
                  "the device, in your own kernel");
    }
    original_.callBoxed(op, keys, stack);
  }

  // copy_(self=dst, src) / _copy_from(self=src, dst): a host destination, a device source
  static bool leaves_device(const torch::jit::Stack& stack, bool dst_first) {
    if (stack.size() < 2 || !stack[0].isTensor() || !stack[1].isTensor()) return false;
    const auto& dst = stack[dst_first ? 0 : 1].toTensor();
    const auto& src = stack[dst_first ? 1 : 0].toTensor();
    return dst.device().is_cpu() && !src.device().is_cpu();
  }

  c10::SafeKernelFunction original_;
  std::string name_;
  bool dst_first_ = name_ == "aten::copy_";
};

// Overriding a kernel warns once ("Overriding a previously registered kernel"): expected here.
struct Quiet final : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

std::vector<std::string> strings(PyObject* seq) {
  std::vector<std::string> out;
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of str");
  if (fast == nullptr) return out;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const char* s = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(fast, i));
    if (s == nullptr) {
      Py_DECREF(fast);
      return {};
    }
    out.emplace_back(s);
  }
  Py_DECREF(fast);
  return out;
}

PyObject* install(PyObject*, PyObject* args) {
  PyObject *ops_obj, *keys_obj;
  if (!PyArg_ParseTuple(args, "OO:install", &ops_obj, &keys_obj)) return nullptr;
  if (g_api == nullptr) {
    g_api = static_cast<KilnNativeAPI*>(PyCapsule_Import("kiln_native._C_API", 0));
    if (g_api == nullptr) return nullptr;
  }
  if (g_api->sealed()) {
    g_api->refused("tamper", "kiln_fence.install");
    PyErr_SetString(PyExc_RuntimeError, "kiln_fence.install is not allowed in the verifier's sandbox");
    return nullptr;
  }
  auto ops = strings(ops_obj);
  auto keys = strings(keys_obj);
  if (PyErr_Occurred()) return nullptr;
  int registered = 0;
  try {
    Quiet quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", std::nullopt, __FILE__, __LINE__);
    for (const auto& full : ops) {
      auto dot = full.find('.');
      std::string name = dot == std::string::npos ? full : full.substr(0, dot);
      std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
      auto handle = c10::Dispatcher::singleton().findOp(c10::OperatorName("aten::" + name, overload));
      if (!handle) continue;
      for (const auto& key_name : keys) {
        c10::DispatchKey key = c10::parseDispatchKey(key_name);
        if (!handle->hasComputedKernelForDispatchKey(key)) continue;
        auto original = handle->getComputedKernelForDispatchKey(key);
        lib->impl(full.c_str(), torch::dispatch(key, torch::CppFunction::makeFromBoxedFunctor(
                                                         std::make_unique<FenceKernel>(std::move(original), name))));
        ++registered;
      }
    }
    g_libraries.push_back(std::move(lib));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return PyLong_FromLong(registered);
}

// guard_copies(ops, keys): HostGuard in front of the named copy ops at the named (device) keys
PyObject* guard_copies(PyObject*, PyObject* args) {
  PyObject *ops_obj, *keys_obj;
  if (!PyArg_ParseTuple(args, "OO:guard_copies", &ops_obj, &keys_obj)) return nullptr;
  if (g_api == nullptr || g_api->sealed()) {
    PyErr_SetString(PyExc_RuntimeError, "kiln_fence.guard_copies runs once, after install and before arming");
    return nullptr;
  }
  auto ops = strings(ops_obj);
  auto keys = strings(keys_obj);
  if (PyErr_Occurred()) return nullptr;
  int registered = 0;
  try {
    Quiet quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", std::nullopt, __FILE__, __LINE__);
    for (const auto& name : ops) {
      auto handle = c10::Dispatcher::singleton().findOp(c10::OperatorName("aten::" + name, ""));
      if (!handle) continue;
      for (const auto& key_name : keys) {
        c10::DispatchKey key = c10::parseDispatchKey(key_name);
        if (!handle->hasComputedKernelForDispatchKey(key)) continue;
        auto original = handle->getComputedKernelForDispatchKey(key);
        lib->impl(name.c_str(), torch::dispatch(key, torch::CppFunction::makeFromBoxedFunctor(
                                                          std::make_unique<HostGuard>(std::move(original), name))));
        ++registered;
      }
    }
    g_libraries.push_back(std::move(lib));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return PyLong_FromLong(registered);
}

// ------------------------------------------------------------------ the sandbox's data movement

// The dispatch keys through which Python code could see or change an op: dispatch modes and tensor
// subclasses (Python, PythonTLSSnapshot), the Python dispatcher and pre-dispatch tracing, functorch's
// layers and functionalization.
c10::DispatchKeySet interception() {
  return c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                              c10::DispatchKey::PythonDispatcher, c10::DispatchKey::PreDispatch,
                              c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
                              c10::DispatchKey::FuncTorchDynamicLayerBackMode, c10::DispatchKey::Functionalize});
}

struct Plain {
  c10::impl::ExcludeDispatchKeyGuard no_python{interception()};
  at::AutoDispatchBelowADInplaceOrView below_autograd;
};

bool exact_tensor(PyObject* obj) { return Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(THPVariableClass); }

bool int_list(PyObject* seq, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of int");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
    out.push_back(v);
  }
  Py_DECREF(fast);
  return true;
}

PyObject* int_tuple(c10::IntArrayRef values) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (t == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(values[i]));
  return t;
}

#define KILN_TRY try {
#define KILN_CATCH                                   \
  }                                                  \
  catch (const std::exception& e) {                  \
    PyErr_SetString(PyExc_RuntimeError, e.what());   \
    return nullptr;                                  \
  }

// plain(obj) -> bool: obj is exactly a torch.Tensor (no subclass, no Parameter)
PyObject* plain(PyObject*, PyObject* obj) { return PyBool_FromLong(exact_tensor(obj)); }

// meta(t) -> (dtype, shape, strides, device type, nbytes): read from the tensor itself, not from
// Python attributes a candidate could have replaced
PyObject* meta(PyObject*, PyObject* obj) {
  if (!exact_tensor(obj)) return PyErr_Format(PyExc_TypeError, "not a plain tensor"), nullptr;
  KILN_TRY
  const at::Tensor& t = THPVariable_Unpack(obj);
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  Py_INCREF(dtype);
  std::string device = c10::DeviceTypeName(t.device().type(), /*lower_case=*/true);
  return Py_BuildValue("(NNNsL)", dtype, int_tuple(t.sizes()), int_tuple(t.strides()), device.c_str(),
                       static_cast<long long>(t.numel() * static_cast<int64_t>(t.element_size())));
  KILN_CATCH
}

// span(t) -> (first byte, one past the last byte, dense): the memory t's elements occupy, and whether
// they cover it without gaps or overlaps (non-overlapping and dense): an output that shares memory
// with an input is no output of its own; one that is not dense is materialised where it is timed
PyObject* span(PyObject*, PyObject* obj) {
  if (!exact_tensor(obj)) return PyErr_Format(PyExc_TypeError, "not a plain tensor"), nullptr;
  KILN_TRY
  const at::Tensor& t = THPVariable_Unpack(obj);
  auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  long long lo = 0, hi = 0;
  if (t.numel() > 0) {
    for (int64_t d = 0; d < t.dim(); ++d) {
      long long extent = (t.size(d) - 1) * t.stride(d);
      (extent < 0 ? lo : hi) += extent;
    }
    hi += 1;
  }
  auto size = static_cast<long long>(t.element_size());
  bool dense = t.is_non_overlapping_and_dense();
  return Py_BuildValue("(KKO)", static_cast<unsigned long long>(base + lo * size),
                       static_cast<unsigned long long>(base + hi * size), dense ? Py_True : Py_False);
  KILN_CATCH
}

// dense(items) -> items itself when every tensor in the tuple is non-overlapping and dense, else a
// new tuple in which each one that is not is replaced by a dense copy made now (on the current
// stream): the materialisation a strided output still needs, charged to the call that returned it
PyObject* dense(PyObject*, PyObject* items) {
  if (!PyTuple_CheckExact(items)) return PyErr_Format(PyExc_TypeError, "expected a tuple"), nullptr;
  Py_ssize_t n = PyTuple_GET_SIZE(items);
  PyObject* out = nullptr;
  KILN_TRY
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(items, i);
    if (!exact_tensor(obj)) {
      Py_XDECREF(out);
      return PyErr_Format(PyExc_TypeError, "not a plain tensor");
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.is_non_overlapping_and_dense()) continue;
    if (out == nullptr) {
      out = PyTuple_GetSlice(items, 0, n);
      if (out == nullptr) return nullptr;
    }
    Plain plain_;
    struct Own {
      Own() { t_sandbox_copy = true; }
      ~Own() { t_sandbox_copy = false; }
    } own;
    at::Tensor copy = at::empty(t.sizes(), t.options());
    copy.copy_(t);
    PyObject* wrapped = THPVariable_Wrap(std::move(copy));
    if (wrapped == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    Py_SETREF(PyTuple_GET_ITEM(out, i), wrapped);  // the slice's own reference to the strided one
  }
  if (out != nullptr) return out;
  Py_INCREF(items);
  return items;
  KILN_CATCH
}

// precomputed() -> elements ATen's compute produced between the seal and arming (before any input)
PyObject* precomputed(PyObject*, PyObject*) { return PyLong_FromLongLong(g_precomputed.load()); }

// empty(shape, dtype, device) -> a fresh contiguous tensor
PyObject* empty(PyObject*, PyObject* args) {
  PyObject *shape_obj, *dtype_obj;
  const char* device;
  if (!PyArg_ParseTuple(args, "OO!s:empty", &shape_obj, &THPDtypeType, &dtype_obj, &device)) return nullptr;
  std::vector<int64_t> shape;
  if (!int_list(shape_obj, shape)) return nullptr;
  KILN_TRY
  Plain plain_;
  auto dtype = reinterpret_cast<THPDtype*>(dtype_obj)->scalar_type;
  return THPVariable_Wrap(at::empty(shape, at::TensorOptions().dtype(dtype).device(c10::Device(device))));
  KILN_CATCH
}

// bytes_view(base, offset, nbytes, dtype, shape) -> a contiguous view of `nbytes` bytes of the
// one-dimensional uint8 tensor `base` at `offset`, as `dtype` of `shape`
PyObject* bytes_view(PyObject*, PyObject* args) {
  PyObject *base_obj, *dtype_obj, *shape_obj;
  long long offset, nbytes;
  if (!PyArg_ParseTuple(args, "OLLO!O:bytes_view", &base_obj, &offset, &nbytes, &THPDtypeType, &dtype_obj, &shape_obj))
    return nullptr;
  if (!exact_tensor(base_obj)) return PyErr_Format(PyExc_TypeError, "not a plain tensor"), nullptr;
  std::vector<int64_t> shape;
  if (!int_list(shape_obj, shape)) return nullptr;
  KILN_TRY
  Plain plain_;
  const at::Tensor& base = THPVariable_Unpack(base_obj);
  auto dtype = reinterpret_cast<THPDtype*>(dtype_obj)->scalar_type;
  TORCH_CHECK(base.dim() == 1 && base.scalar_type() == at::kByte, "the base must be a 1-d uint8 tensor");
  TORCH_CHECK(offset >= 0 && nbytes >= 0 && offset + nbytes <= base.numel(), "the view is outside its base");
  int64_t numel = 1;
  for (auto s : shape) numel *= s;
  TORCH_CHECK(numel * static_cast<int64_t>(c10::elementSize(dtype)) == nbytes, "shape and dtype do not fill the view");
  if (nbytes == 0) return THPVariable_Wrap(at::empty(shape, base.options().dtype(dtype)));
  return THPVariable_Wrap(base.narrow(0, offset, nbytes).view(dtype).view(shape));
  KILN_CATCH
}

// copy(dst, src, non_blocking=False): dst.copy_(src)
PyObject* copy(PyObject*, PyObject* args) {
  PyObject *dst_obj, *src_obj;
  int non_blocking = 0;
  if (!PyArg_ParseTuple(args, "OO|p:copy", &dst_obj, &src_obj, &non_blocking)) return nullptr;
  if (!exact_tensor(dst_obj) || !exact_tensor(src_obj)) return PyErr_Format(PyExc_TypeError, "not a plain tensor"), nullptr;
  KILN_TRY
  Plain plain_;
  struct Own {
    Own() { t_sandbox_copy = true; }
    ~Own() { t_sandbox_copy = false; }
  } own;
  at::Tensor dst = THPVariable_Unpack(dst_obj);
  dst.copy_(THPVariable_Unpack(src_obj), non_blocking != 0);
  Py_RETURN_NONE;
  KILN_CATCH
}

// poison(t): t filled with NaN (floating point) or its dtype's largest value (integers), so that a read
// of it before the sandbox's copy lands shows in the outputs
PyObject* poison(PyObject*, PyObject* obj) {
  if (!exact_tensor(obj)) return PyErr_Format(PyExc_TypeError, "not a plain tensor"), nullptr;
  KILN_TRY
  Plain plain_;
  at::Tensor t = THPVariable_Unpack(obj);
  if (t.is_floating_point()) t.fill_(std::numeric_limits<double>::quiet_NaN());
  else if (t.scalar_type() == at::kBool) t.fill_(true);
  else t.fill_(127);
  Py_RETURN_NONE;
  KILN_CATCH
}

PyMethodDef methods[] = {
    {"plain", plain, METH_O, "plain(obj) -> bool: exactly a torch.Tensor"},
    {"poison", poison, METH_O, "poison(t): NaN (or a large value) everywhere"},
    {"meta", meta, METH_O, "meta(t) -> (dtype, shape, strides, device type, nbytes)"},
    {"span", span, METH_O, "span(t) -> (first byte, one past the last, non-overlapping and dense)"},
    {"dense", dense, METH_O, "dense(items) -> items, or a tuple with dense copies of the strided ones"},
    {"precomputed", precomputed, METH_NOARGS, "precomputed() -> elements ATen computed after the seal, before arming"},
    {"empty", empty, METH_VARARGS, "empty(shape, dtype, device) -> Tensor"},
    {"bytes_view", bytes_view, METH_VARARGS, "bytes_view(base, offset, nbytes, dtype, shape) -> Tensor"},
    {"copy", copy, METH_VARARGS, "copy(dst, src, non_blocking=False)"},
    {"install", install, METH_VARARGS,
     "install(ops, keys) -> kernels registered; refuses once the process is armed (kiln_native.arm)"},
    {"guard_copies", guard_copies, METH_VARARGS,
     "guard_copies(ops, keys) -> kernels registered: device-to-host copies refuse once armed"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "kiln_fence", nullptr, -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_kiln_fence(void) { return PyModule_Create(&module_def); }
