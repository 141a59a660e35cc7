"""The CUDA facade's headers, the only tensor surface a facade-built candidate's host code sees: C++ text.

* `kiln_facade.h` (FACADE_HEADER): the handle class `kiln::fc::Tensor` (one TensorImpl pointer
  holding a reference; every method is out of line), ScalarType/Device/TensorOptions/IntArrayRef,
  the allocation functions, the stream. Includable next to the real torch headers.
* `facade_cuda.h` (FACADE_CUDA_PRELUDE, the prelude nvcc sees): the facade plus the torch/at/c10
  spellings of it, TORCH_CHECK, C10_CUDA_CHECK, C10_CUDA_KERNEL_LAUNCH_CHECK and AT_DISPATCH_* for
  the usual types.
The out-of-line parts these declare are the facade library's (facade_lib.py); facade.py says when a
candidate is built with the facade.
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

# The C++ text names facade_lib.py, where it was written first: it stays byte for byte, because the
# toolchain's id hashes every prelude (preludes.py), and with it every cached precompiled header.
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
