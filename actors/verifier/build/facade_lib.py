"""The CUDA facade's library (facade.py says when a candidate is built with the facade): C++ text only.

* `kiln_facade_bridge.h` (FACADE_BRIDGE): the conversion between `at::Tensor` and the facade handle
  of `kiln_facade.h` (facade_headers.py, with the prelude nvcc sees).
* The facade thunk binding (`kiln_facade_thunk.h`, thunks.py) fills the opaque argument and result
  values through accessors that this library defines.
* `facade.cpp` (FACADE_LIB_SOURCE): the out-of-line parts of `kiln_facade.h`, compiled once per
  toolchain by the trusted service against real ATen (like the thunk module shell) and linked into
  facade-built extensions. It only allocates, reads metadata and converts: what it imports is tensor
  plumbing. It also defines the facade thunk ABI's accessors (kiln_facade_thunk.h, thunks.py).
"""

from __future__ import annotations

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
