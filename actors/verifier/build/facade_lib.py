"""The CUDA facade's sources (facade.py says when a candidate is built with it): C++ text only.

* `kiln_facade.h` (FACADE_HEADER): the handle class `kiln::fc::Tensor` (one TensorImpl pointer
  holding a reference; every method is out of line), ScalarType/Device/TensorOptions/IntArrayRef,
  the allocation functions, the stream. Includable next to the real torch headers.
* `facade_cuda.h` (FACADE_CUDA_PRELUDE, the prelude nvcc sees): the facade plus the torch/at/c10
  spellings of it, TORCH_CHECK, C10_CUDA_CHECK, C10_CUDA_KERNEL_LAUNCH_CHECK and AT_DISPATCH_* for
  the usual types.
* `kiln_facade_bridge.h` (FACADE_BRIDGE): the conversion between `at::Tensor` and the facade handle.
* The facade thunk binding (`kiln_facade_thunk.h`, thunks.py) fills the opaque argument and result
  values through accessors that this library defines.
* `facade.cpp` (FACADE_LIB_SOURCE): the out-of-line parts, compiled once per toolchain by the
  trusted service against real ATen (like the thunk module shell) and linked into facade-built
  extensions. It only allocates, reads metadata and converts: what it imports is tensor plumbing.
  It also defines the facade thunk ABI's accessors (kiln_facade_thunk.h, thunks.py).
"""

from __future__ import annotations

FACADE_HEADER = r"""// Kiln CUDA facade: the tensor surface of CUDA candidates' host code, without torch headers
#ifndef KILN_FACADE_H
#define KILN_FACADE_H
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace kiln {
namespace fc {

// Values as c10::ScalarType / c10::DeviceType number them (checked where both are visible).
enum class ScalarType : int8_t {
  Byte = 0, Char = 1, Short = 2, Int = 3, Long = 4, Half = 5, Float = 6, Double = 7,
  ComplexHalf = 8, ComplexFloat = 9, ComplexDouble = 10, Bool = 11, BFloat16 = 15, Undefined = 127
};
enum class DeviceType : int8_t { CPU = 0, CUDA = 1 };
enum class MemoryFormat : int8_t { Contiguous = 0, Preserve = 1, ChannelsLast = 2, ChannelsLast3d = 3 };

const char* scalar_type_name(ScalarType t);
int64_t element_size(ScalarType t);

struct Device {
  DeviceType type_ = DeviceType::CPU;
  int8_t index_ = -1;
  Device() = default;
  Device(DeviceType t, int index = -1) : type_(t), index_(static_cast<int8_t>(index)) {}
  DeviceType type() const { return type_; }
  int8_t index() const { return index_; }
  bool has_index() const { return index_ >= 0; }
  bool is_cuda() const { return type_ == DeviceType::CUDA; }
  bool is_cpu() const { return type_ == DeviceType::CPU; }
  bool operator==(const Device& o) const { return type_ == o.type_ && index_ == o.index_; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

struct TensorOptions {
  ScalarType dtype_ = ScalarType::Float;
  Device device_{};
  MemoryFormat memory_format_ = MemoryFormat::Contiguous;
  bool has_dtype_ = false, has_device_ = false, requires_grad_ = false, has_memory_format_ = false;
  TensorOptions() = default;
  TensorOptions(ScalarType t) { dtype_ = t; has_dtype_ = true; }
  TensorOptions(Device d) { device_ = d; has_device_ = true; }
  TensorOptions(DeviceType t) { device_ = Device(t); has_device_ = true; }
  TensorOptions dtype(ScalarType t) const { TensorOptions o = *this; o.dtype_ = t; o.has_dtype_ = true; return o; }
  TensorOptions device(Device d) const { TensorOptions o = *this; o.device_ = d; o.has_device_ = true; return o; }
  TensorOptions device(DeviceType t, int index = -1) const { return device(Device(t, index)); }
  TensorOptions requires_grad(bool r) const { TensorOptions o = *this; o.requires_grad_ = r; return o; }
  TensorOptions memory_format(MemoryFormat m) const {
    TensorOptions o = *this; o.memory_format_ = m; o.has_memory_format_ = true; return o;
  }
  ScalarType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool requires_grad() const { return requires_grad_; }
};
inline TensorOptions dtype(ScalarType t) { return TensorOptions().dtype(t); }
inline TensorOptions device(Device d) { return TensorOptions().device(d); }
inline TensorOptions device(DeviceType t, int index = -1) { return TensorOptions().device(t, index); }
inline TensorOptions requires_grad(bool r = true) { return TensorOptions().requires_grad(r); }

// A view of int64 values (sizes, strides, shape arguments); it does not own them.
class IntArrayRef {
 public:
  IntArrayRef() = default;
  IntArrayRef(const int64_t& one) : data_(&one), size_(1) {}
  IntArrayRef(const int64_t* data, size_t size) : data_(data), size_(size) {}
  IntArrayRef(const std::vector<int64_t>& v) : data_(v.data()), size_(v.size()) {}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"  // a view of a braced list lives for the call, as in c10
#endif
  IntArrayRef(std::initializer_list<int64_t> l) : data_(l.begin()), size_(l.size()) {}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  const int64_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const int64_t* begin() const { return data_; }
  const int64_t* end() const { return data_ + size_; }
  int64_t operator[](size_t i) const { return data_[i]; }
  int64_t front() const { return data_[0]; }
  int64_t back() const { return data_[size_ - 1]; }
  std::vector<int64_t> vec() const { return std::vector<int64_t>(begin(), end()); }
  bool equals(IntArrayRef o) const { return size_ == o.size_ && std::equal(begin(), end(), o.begin()); }
  bool operator==(IntArrayRef o) const { return equals(o); }
  bool operator!=(IntArrayRef o) const { return !equals(o); }
 private:
  const int64_t* data_ = nullptr;
  size_t size_ = 0;
};

template <typename T> struct TypeOf;  // the ScalarType of a C++ element type (data_ptr<T>)
template <> struct TypeOf<float> { static constexpr ScalarType value = ScalarType::Float; };
template <> struct TypeOf<double> { static constexpr ScalarType value = ScalarType::Double; };
template <> struct TypeOf<int32_t> { static constexpr ScalarType value = ScalarType::Int; };
template <> struct TypeOf<int64_t> { static constexpr ScalarType value = ScalarType::Long; };
template <> struct TypeOf<int16_t> { static constexpr ScalarType value = ScalarType::Short; };
template <> struct TypeOf<int8_t> { static constexpr ScalarType value = ScalarType::Char; };
template <> struct TypeOf<uint8_t> { static constexpr ScalarType value = ScalarType::Byte; };
template <> struct TypeOf<bool> { static constexpr ScalarType value = ScalarType::Bool; };

// A reference-holding handle to a torch TensorImpl. Undefined is nullptr.
class Tensor {
 public:
  Tensor() = default;
  Tensor(const Tensor& o);
  Tensor(Tensor&& o) noexcept : impl_(o.impl_) { o.impl_ = nullptr; }
  Tensor& operator=(const Tensor& o);
  Tensor& operator=(Tensor&& o) noexcept { std::swap(impl_, o.impl_); return *this; }
  ~Tensor();
  static Tensor adopt(void* impl) { Tensor t; t.impl_ = impl; return t; }  // takes over one reference
  void* release() { void* p = impl_; impl_ = nullptr; return p; }
  void* unsafeGetTensorImpl() const { return impl_; }

  bool defined() const { return impl_ != nullptr; }
  int64_t dim() const;
  int64_t ndimension() const { return dim(); }
  int64_t numel() const;
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  IntArrayRef sizes() const;
  IntArrayRef strides() const;
  int64_t storage_offset() const;
  ScalarType scalar_type() const;
  ScalarType dtype() const { return scalar_type(); }
  int64_t element_size() const { return fc::element_size(scalar_type()); }
  int64_t itemsize() const { return element_size(); }
  size_t nbytes() const { return static_cast<size_t>(numel() * element_size()); }
  Device device() const;
  int64_t get_device() const { return device().index(); }
  bool is_cuda() const { return device().is_cuda(); }
  bool is_cpu() const { return device().is_cpu(); }
  bool is_contiguous() const;
  bool is_contiguous(MemoryFormat m) const;
  bool requires_grad() const;
  TensorOptions options() const;
  Tensor contiguous() const;
  Tensor contiguous(MemoryFormat m) const;
  // Views, copies and fills (tensor plumbing, as the legality rules count it).
  Tensor view(IntArrayRef size) const;
  Tensor reshape(IntArrayRef size) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor permute(IntArrayRef dims) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const { return transpose(0, 1); }
  Tensor unsqueeze(int64_t d) const;
  Tensor squeeze(int64_t d) const;
  Tensor narrow(int64_t d, int64_t start, int64_t length) const;
  Tensor select(int64_t d, int64_t index) const;
  Tensor expand(IntArrayRef size) const;
  Tensor detach() const;
  Tensor clone() const;
  Tensor to(ScalarType t) const;
  Tensor& zero_();
  Tensor& fill_(double value);
  Tensor& copy_(const Tensor& src);
  void* data_ptr() const;
  const void* const_data_ptr() const { return data_ptr(); }
  void* mutable_data_ptr() const { return data_ptr(); }
  template <typename T> T* data_ptr() const { return static_cast<T*>(typed_data_ptr(TypeOf<std::remove_cv_t<T>>::value)); }
  template <typename T> const T* const_data_ptr() const { return data_ptr<T>(); }
  template <typename T> T* mutable_data_ptr() const { return data_ptr<T>(); }
  template <typename T> T* data() const { return data_ptr<T>(); }
 private:
  void* typed_data_ptr(ScalarType want) const;
  void* impl_ = nullptr;
};

Tensor empty(IntArrayRef size, TensorOptions options = {});
Tensor empty_strided(IntArrayRef size, IntArrayRef stride, TensorOptions options = {});
Tensor empty_like(const Tensor& t, TensorOptions options = {});
Tensor zeros(IntArrayRef size, TensorOptions options = {});
Tensor zeros_like(const Tensor& t, TensorOptions options = {});
Tensor ones(IntArrayRef size, TensorOptions options = {});
Tensor ones_like(const Tensor& t, TensorOptions options = {});
Tensor full(IntArrayRef size, double value, TensorOptions options = {});
Tensor full_like(const Tensor& t, double value, TensorOptions options = {});

struct CUDAStream {
  cudaStream_t stream_ = nullptr;
  Device device_{DeviceType::CUDA, -1};
  cudaStream_t stream() const { return stream_; }
  operator cudaStream_t() const { return stream_; }
  Device device() const { return device_; }
  int8_t device_index() const { return device_.index(); }
};
CUDAStream getCurrentCUDAStream(int device_index = -1);

// Sets the current CUDA device for a scope (what c10::cuda::CUDAGuard does for one device).
class CUDAGuard {
 public:
  explicit CUDAGuard(int index) { cudaGetDevice(&prev_); if (index >= 0 && index != prev_) cudaSetDevice(index); }
  explicit CUDAGuard(Device d) : CUDAGuard(d.is_cuda() ? d.index() : -1) {}
  CUDAGuard(const CUDAGuard&) = delete;
  CUDAGuard& operator=(const CUDAGuard&) = delete;
  ~CUDAGuard() { int now = -1; cudaGetDevice(&now); if (now != prev_) cudaSetDevice(prev_); }
 private:
  int prev_ = 0;
};
inline Device device_of(const Tensor& t) { return t.device(); }

namespace detail {
// TORCH_CHECK's message: its arguments concatenated, as c10::str does for the common types.
inline void append(std::string& s, const char* x) { s += x; }
inline void append(std::string& s, const std::string& x) { s += x; }
inline void append(std::string& s, char x) { s += x; }
inline void append(std::string& s, bool x) { s += x ? "1" : "0"; }
inline void append(std::string& s, ScalarType x) { s += scalar_type_name(x); }
template <typename T>
std::enable_if_t<std::is_integral<T>::value> append(std::string& s, T x) {
  s += std::to_string(x);
}
template <typename T>
std::enable_if_t<std::is_floating_point<T>::value> append(std::string& s, T x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(x));
  s += buf;
}
inline void append(std::string& s, IntArrayRef x) {
  s += "[";
  for (size_t k = 0; k < x.size(); ++k) { if (k) s += ", "; s += std::to_string(x[k]); }
  s += "]";
}
[[noreturn]] void check_failed(const char* func, const char* file, int line, const std::string& msg);
[[noreturn]] void cuda_failed(cudaError_t err, const char* file, int line);
[[noreturn]] void dispatch_failed(const char* name, ScalarType t);
template <typename... A>
[[noreturn]] void fail(const char* func, const char* file, int line, const char* cond, const A&... a) {
  std::string s;
  if (sizeof...(A) == 0) {
    s = std::string("Expected ") + cond + " to be true, but got false.  (Could this error message be improved?  "
        "If so, please report an enhancement request to PyTorch.)";
  }
  (append(s, a), ...);
  check_failed(func, file, line, s);
}
}  // namespace detail
}  // namespace fc
}  // namespace kiln
#endif
"""

_DISPATCH_CASE = "case ::kiln::fc::ScalarType::{name}: {{ using scalar_t = {ctype}; return __VA_ARGS__(); }}"
_DISPATCH_SETS = {
    "AT_DISPATCH_FLOATING_TYPES": (("Float", "float"), ("Double", "double")),
    "AT_DISPATCH_INTEGRAL_TYPES": (
        ("Byte", "uint8_t"),
        ("Char", "int8_t"),
        ("Short", "int16_t"),
        ("Int", "int32_t"),
        ("Long", "int64_t"),
    ),
    "AT_DISPATCH_ALL_TYPES": (
        ("Byte", "uint8_t"),
        ("Char", "int8_t"),
        ("Short", "int16_t"),
        ("Int", "int32_t"),
        ("Long", "int64_t"),
        ("Float", "float"),
        ("Double", "double"),
    ),
}


def _dispatch_macros() -> str:
    out = []
    for macro, cases in _DISPATCH_SETS.items():
        body = " ".join(_DISPATCH_CASE.format(name=n, ctype=c) for n, c in cases)
        out.append(
            f"#define {macro}(TYPE, NAME, ...) [&] {{ const ::kiln::fc::ScalarType _kiln_st = (TYPE); "
            f"switch (_kiln_st) {{ {body} default: ::kiln::fc::detail::dispatch_failed(NAME, _kiln_st); }} }}()"
        )
    return "\n".join(out) + "\n"


_SCALAR_CONSTANTS = "\n".join(
    f"constexpr ScalarType {k} = ScalarType::{v};"
    for k, v in (
        ("kByte", "Byte"),
        ("kChar", "Char"),
        ("kShort", "Short"),
        ("kInt", "Int"),
        ("kLong", "Long"),
        ("kHalf", "Half"),
        ("kFloat", "Float"),
        ("kDouble", "Double"),
        ("kBool", "Bool"),
        ("kBFloat16", "BFloat16"),
    )
)
_NAMES = (
    "Tensor",
    "TensorOptions",
    "ScalarType",
    "Device",
    "DeviceType",
    "IntArrayRef",
    "MemoryFormat",
    "empty",
    "empty_strided",
    "empty_like",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "dtype",
    "device",
    "requires_grad",
    "device_of",
)
_USING = "\n".join(f"using ::kiln::fc::{n};" for n in _NAMES)
_CUDA_NS = (
    "namespace cuda {\nusing ::kiln::fc::CUDAStream;\nusing ::kiln::fc::getCurrentCUDAStream;\n"
    "using ::kiln::fc::CUDAGuard;\nusing OptionalCUDAGuard = ::kiln::fc::CUDAGuard;\n}  // namespace cuda\n"
)
_COMMON_NS = (
    f"{_USING}\n{_SCALAR_CONSTANTS}\nconstexpr DeviceType kCUDA = DeviceType::CUDA;\n"
    f"constexpr DeviceType kCPU = DeviceType::CPU;\n{_CUDA_NS}"
)

FACADE_CUDA_PRELUDE = (
    "// Kiln facade prelude (CUDA): torch's spellings of the facade, no torch header (facade_lib.py)\n"
    '#ifndef KILN_FACADE_CUDA_H\n#define KILN_FACADE_CUDA_H\n#include "kiln_facade.h"\n'
    f"namespace c10 {{\n{_COMMON_NS}}}  // namespace c10\n"
    f"namespace at {{\n{_COMMON_NS}}}  // namespace at\n"
    "namespace torch {\nusing namespace at;\nusing Dtype = ScalarType;\n"
    + "\n".join(
        f"constexpr ScalarType {k} = ScalarType::{v};"
        for k, v in (
            ("kUInt8", "Byte"),
            ("kInt8", "Char"),
            ("kInt16", "Short"),
            ("kInt32", "Int"),
            ("kInt64", "Long"),
            ("kFloat16", "Half"),
            ("kFloat32", "Float"),
            ("kFloat64", "Double"),
            ("kU8", "Byte"),
            ("kI8", "Char"),
            ("kI16", "Short"),
            ("kI32", "Int"),
            ("kI64", "Long"),
            ("kF16", "Half"),
            ("kF32", "Float"),
            ("kF64", "Double"),
        )
    )
    + "\n}  // namespace torch\n"
    "#define TORCH_CHECK(cond, ...) \\\n  do { if (!(cond)) ::kiln::fc::detail::fail(__func__, __FILE__, __LINE__, "
    "#cond, ##__VA_ARGS__); } while (0)\n"
    "#define TORCH_INTERNAL_ASSERT(cond, ...) TORCH_CHECK(cond, ##__VA_ARGS__)\n"
    "#define C10_CUDA_CHECK(expr) \\\n  do { const cudaError_t _kiln_err = (expr); "
    "if (_kiln_err != cudaSuccess) ::kiln::fc::detail::cuda_failed(_kiln_err, __FILE__, __LINE__); } while (0)\n"
    "#define C10_CUDA_KERNEL_LAUNCH_CHECK() C10_CUDA_CHECK(cudaGetLastError())\n" + _dispatch_macros() + "#endif\n"
)

# The conversions between torch's tensor and the facade handle, for the facade library (compiled by
# g++ against the real ATen headers once per toolchain).
FACADE_BRIDGE = r"""// Kiln facade bridge: at::Tensor <-> kiln::fc::Tensor (facade_lib.py)
#ifndef KILN_FACADE_BRIDGE_H
#define KILN_FACADE_BRIDGE_H
#include <ATen/core/Tensor.h>
#include "kiln_facade.h"

namespace kiln {
namespace fc {

inline Tensor from_aten(at::Tensor t) {
  return t.defined() ? Tensor::adopt(t.unsafeReleaseTensorImpl()) : Tensor();
}
inline at::Tensor to_aten(const Tensor& t) {
  if (!t.defined()) return at::Tensor();
  return at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::unsafe_reclaim_from_nonowning(
      static_cast<c10::TensorImpl*>(t.unsafeGetTensorImpl())));
}

}  // namespace fc
}  // namespace kiln
#endif
"""

FACADE_LIB_SOURCE = r"""// Kiln facade library: the out-of-line parts of kiln_facade.h, on real ATen (facade_lib.py)
#include "lean.h"
#include "kiln_facade_bridge.h"
#include "kiln_facade_thunk.h"
#include "kiln_thunk.h"
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/Stream.h>

namespace kiln {
namespace fc {

static_assert(static_cast<int>(ScalarType::Float) == static_cast<int>(c10::ScalarType::Float), "ScalarType");
static_assert(static_cast<int>(ScalarType::Long) == static_cast<int>(c10::ScalarType::Long), "ScalarType");
static_assert(static_cast<int>(ScalarType::Bool) == static_cast<int>(c10::ScalarType::Bool), "ScalarType");
static_assert(static_cast<int>(ScalarType::Half) == static_cast<int>(c10::ScalarType::Half), "ScalarType");
static_assert(static_cast<int>(ScalarType::BFloat16) == static_cast<int>(c10::ScalarType::BFloat16), "ScalarType");
static_assert(static_cast<int>(DeviceType::CUDA) == static_cast<int>(c10::DeviceType::CUDA), "DeviceType");
static_assert(static_cast<int>(DeviceType::CPU) == static_cast<int>(c10::DeviceType::CPU), "DeviceType");

namespace {
// A temporary at::Tensor sharing the handle's TensorImpl (one reference more while it lives).
at::Tensor borrow(const Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), what, "() called on an undefined Tensor");
  return to_aten(t);
}
c10::TensorImpl* impl(const Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), what, "() called on an undefined Tensor");
  return static_cast<c10::TensorImpl*>(t.unsafeGetTensorImpl());
}
ScalarType ours(c10::ScalarType t) { return static_cast<ScalarType>(static_cast<int8_t>(t)); }
c10::ScalarType theirs(ScalarType t) { return static_cast<c10::ScalarType>(static_cast<int8_t>(t)); }
Device ours(c10::Device d) { return Device(static_cast<DeviceType>(static_cast<int8_t>(d.type())), d.index()); }
c10::Device theirs(Device d) { return c10::Device(static_cast<c10::DeviceType>(static_cast<int8_t>(d.type())), d.index()); }
c10::MemoryFormat theirs(MemoryFormat m) { return static_cast<c10::MemoryFormat>(static_cast<int8_t>(m)); }
at::TensorOptions theirs(const TensorOptions& o) {
  at::TensorOptions r;
  if (o.has_dtype_) r = r.dtype(theirs(o.dtype_));
  if (o.has_device_) r = r.device(theirs(o.device_));
  if (o.requires_grad_) r = r.requires_grad(true);
  return r;
}
std::optional<c10::MemoryFormat> format_of(const TensorOptions& o) {
  return o.has_memory_format_ ? std::optional<c10::MemoryFormat>(theirs(o.memory_format_)) : std::nullopt;
}
}  // namespace

const char* scalar_type_name(ScalarType t) { return c10::toString(theirs(t)); }
int64_t element_size(ScalarType t) { return static_cast<int64_t>(c10::elementSize(theirs(t))); }

Tensor::Tensor(const Tensor& o) : impl_(o.defined() ? to_aten(o).unsafeReleaseTensorImpl() : nullptr) {}
Tensor& Tensor::operator=(const Tensor& o) {
  if (this != &o) {
    Tensor copy(o);
    std::swap(impl_, copy.impl_);
  }
  return *this;
}
Tensor::~Tensor() {
  if (impl_) c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(static_cast<c10::TensorImpl*>(impl_));
}
int64_t Tensor::dim() const { return impl(*this, "dim")->dim(); }
int64_t Tensor::numel() const { return impl(*this, "numel")->numel(); }
int64_t Tensor::size(int64_t d) const { return borrow(*this, "size").size(d); }
int64_t Tensor::stride(int64_t d) const { return borrow(*this, "stride").stride(d); }
IntArrayRef Tensor::sizes() const {
  c10::IntArrayRef s = impl(*this, "sizes")->sizes();
  return IntArrayRef(s.data(), s.size());
}
IntArrayRef Tensor::strides() const {
  c10::IntArrayRef s = impl(*this, "strides")->strides();
  return IntArrayRef(s.data(), s.size());
}
int64_t Tensor::storage_offset() const { return impl(*this, "storage_offset")->storage_offset(); }
ScalarType Tensor::scalar_type() const { return ours(borrow(*this, "scalar_type").scalar_type()); }
Device Tensor::device() const { return ours(borrow(*this, "device").device()); }
bool Tensor::is_contiguous() const { return borrow(*this, "is_contiguous").is_contiguous(); }
bool Tensor::is_contiguous(MemoryFormat m) const { return borrow(*this, "is_contiguous").is_contiguous(theirs(m)); }
bool Tensor::requires_grad() const { return borrow(*this, "requires_grad").requires_grad(); }
TensorOptions Tensor::options() const {
  at::Tensor t = borrow(*this, "options");
  return TensorOptions().dtype(ours(t.scalar_type())).device(ours(t.device()));
}
Tensor Tensor::contiguous() const { return from_aten(borrow(*this, "contiguous").contiguous()); }
Tensor Tensor::contiguous(MemoryFormat m) const { return from_aten(borrow(*this, "contiguous").contiguous(theirs(m))); }
namespace {
c10::IntArrayRef theirs(IntArrayRef a) { return c10::IntArrayRef(a.data(), a.size()); }
}  // namespace
Tensor Tensor::view(IntArrayRef size) const { return from_aten(borrow(*this, "view").view(theirs(size))); }
Tensor Tensor::reshape(IntArrayRef size) const { return from_aten(borrow(*this, "reshape").reshape(theirs(size))); }
Tensor Tensor::flatten(int64_t a, int64_t b) const { return from_aten(borrow(*this, "flatten").flatten(a, b)); }
Tensor Tensor::permute(IntArrayRef dims) const { return from_aten(borrow(*this, "permute").permute(theirs(dims))); }
Tensor Tensor::transpose(int64_t a, int64_t b) const { return from_aten(borrow(*this, "transpose").transpose(a, b)); }
Tensor Tensor::unsqueeze(int64_t d) const { return from_aten(borrow(*this, "unsqueeze").unsqueeze(d)); }
Tensor Tensor::squeeze(int64_t d) const { return from_aten(borrow(*this, "squeeze").squeeze(d)); }
Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  return from_aten(borrow(*this, "narrow").narrow(d, start, length));
}
Tensor Tensor::select(int64_t d, int64_t index) const { return from_aten(borrow(*this, "select").select(d, index)); }
Tensor Tensor::expand(IntArrayRef size) const { return from_aten(borrow(*this, "expand").expand(theirs(size))); }
Tensor Tensor::detach() const { return from_aten(borrow(*this, "detach").detach()); }
Tensor Tensor::clone() const { return from_aten(borrow(*this, "clone").clone()); }
Tensor Tensor::to(ScalarType t) const { return from_aten(borrow(*this, "to").to(theirs(t))); }
Tensor& Tensor::zero_() { borrow(*this, "zero_").zero_(); return *this; }
Tensor& Tensor::fill_(double value) { borrow(*this, "fill_").fill_(value); return *this; }
Tensor& Tensor::copy_(const Tensor& src) { borrow(*this, "copy_").copy_(borrow(src, "copy_")); return *this; }
void* Tensor::data_ptr() const { return borrow(*this, "data_ptr").data_ptr(); }
void* Tensor::typed_data_ptr(ScalarType want) const {
  at::Tensor t = borrow(*this, "data_ptr");
  TORCH_CHECK(t.scalar_type() == theirs(want), "expected scalar type ", c10::toString(theirs(want)),
              " but found ", t.scalar_type());
  return t.data_ptr();
}

Tensor empty(IntArrayRef size, TensorOptions o) {
  return from_aten(at::empty(c10::IntArrayRef(size.data(), size.size()), theirs(o), format_of(o)));
}
Tensor empty_strided(IntArrayRef size, IntArrayRef stride, TensorOptions o) {
  return from_aten(at::empty_strided(c10::IntArrayRef(size.data(), size.size()),
                                     c10::IntArrayRef(stride.data(), stride.size()), theirs(o)));
}
Tensor empty_like(const Tensor& t, TensorOptions o) {
  return from_aten(at::empty_like(borrow(t, "empty_like"), theirs(o), format_of(o)));
}
Tensor zeros(IntArrayRef size, TensorOptions o) {
  return from_aten(at::zeros(c10::IntArrayRef(size.data(), size.size()), theirs(o)));
}
Tensor zeros_like(const Tensor& t, TensorOptions o) {
  return from_aten(at::zeros_like(borrow(t, "zeros_like"), theirs(o), format_of(o)));
}
Tensor ones(IntArrayRef size, TensorOptions o) {
  return from_aten(at::ones(c10::IntArrayRef(size.data(), size.size()), theirs(o)));
}
Tensor ones_like(const Tensor& t, TensorOptions o) {
  return from_aten(at::ones_like(borrow(t, "ones_like"), theirs(o), format_of(o)));
}
Tensor full(IntArrayRef size, double value, TensorOptions o) {
  return from_aten(at::full(c10::IntArrayRef(size.data(), size.size()), value, theirs(o)));
}
Tensor full_like(const Tensor& t, double value, TensorOptions o) {
  return from_aten(at::full_like(borrow(t, "full_like"), value, theirs(o), format_of(o)));
}

CUDAStream getCurrentCUDAStream(int device_index) {
  const c10::impl::DeviceGuardImplInterface* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  c10::Device dev = device_index < 0 ? guard->getDevice()
                                     : c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
  c10::Stream s = guard->getStream(dev);
  CUDAStream r;
  r.stream_ = static_cast<cudaStream_t>(s.native_handle());
  r.device_ = Device(DeviceType::CUDA, dev.index());
  return r;
}

namespace thunk {
// The facade thunk ABI (kiln_facade_thunk.h) on the real kiln::Value.
Value* item(Value* values, size_t k) { return values + k; }
Tensor take_tensor(Value* v) { return from_aten(std::move(v->t)); }
int64_t get_int(Value* v) { return v->i; }
double get_double(Value* v) { return v->d; }
bool get_bool(Value* v) { return v->b; }
std::vector<Tensor> take_tensors(Value* v) {
  std::vector<Tensor> r;
  for (at::Tensor& t : v->extra().tl) r.push_back(from_aten(std::move(t)));
  return r;
}
std::vector<int64_t> take_ints(Value* v) { return std::move(v->extra().il); }
void put_tensor(Value* v, Tensor x) { v->code = 'T'; v->t = to_aten(x); }
void put_int(Value* v, char code, int64_t x) { v->code = code; v->i = x; }
void put_double(Value* v, char code, double x) { v->code = code; v->d = x; }
void put_bool(Value* v, bool x) { v->code = 'b'; v->b = x; }
void put_tensors(Value* v, std::vector<Tensor> x) {
  v->code = 'L';
  std::vector<at::Tensor>& out = v->extra().tl;
  out.clear();
  for (const Tensor& t : x) out.push_back(to_aten(t));
}
void put_ints(Value* v, std::vector<int64_t> x) { v->code = 'I'; v->extra().il = std::move(x); }
void put_void(Value* v) { v->code = 'v'; }
Value* put_tuple(Value* v, size_t n) {
  v->code = '(';
  v->extra().tuple.resize(n);
  return v->extra().tuple.data();
}
}  // namespace thunk

namespace detail {
void check_failed(const char* func, const char* file, int line, const std::string& msg) {
  throw c10::Error(c10::SourceLocation{func, file, static_cast<uint32_t>(line)}, msg);
}
void cuda_failed(cudaError_t err, const char* file, int line) {
  check_failed("cuda", file, line, std::string("CUDA error: ") + cudaGetErrorString(err));
}
void dispatch_failed(const char* name, ScalarType t) {
  check_failed(name, "", 0, std::string("\"") + name + "\" not implemented for '" + scalar_type_name(t) + "'");
}
}  // namespace detail
}  // namespace fc
}  // namespace kiln
"""
