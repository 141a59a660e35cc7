"""The pybind11-free binding: a per-signature *thunk* TU plus one shared *module shell*.

Any TU that includes pybind11 pays ~4 s of template instantiation at its end, even with a
precompiled header and an empty module, so a generated pybind11 binding costs ~5 s per new
signature. Kiln splits the binding instead:
* the thunk TU (per signature set, cached like any binding object) includes only the lean prelude
  and `kiln_thunk.h` (its calls are `kiln_thunk_calls.h`'s, shared with the facade mode below); C++ templates turn each bound function into a type-erased call
  `void call(kiln::Value* args, kiln::Value* result)` plus a type descriptor ("T(Tld)": returns a
  Tensor, takes Tensor, int64_t, double), listed in `extern "C" kiln_bindings()`. About 1 s.
* the module shell (once per toolchain, built by the trusted service like a PCH) holds the
  PYBIND11_MODULE: it converts Python arguments with pybind11's own casters for the descriptor's
  types (so conversions match a pybind11 binding), calls the thunk inside torch's error handling
  (what `torch::wrap_pybind_function` does), and converts the result back.
* a facade-mode thunk TU (a CUDA unit built against the facade, facade.py) includes no torch header
  either: `kiln_facade_thunk.h` moves values in and out of the opaque `kiln::Value`
  through the facade library, so it compiles in a fraction of a second with no precompiled header.
A parameter or result type outside the supported set fails the thunk TU's compile (no `Conv<T>`),
and the builder falls back to the generated pybind11 binding, then to one load_inline-style TU.
"""

from __future__ import annotations

import json

# Type codes: T Tensor, l int64_t/long, q long long, i int, d double, f float, b bool,
# L vector<Tensor>, O optional<Tensor>, I vector<int64_t>, A IntArrayRef, s string, v void,
# (...) tuple (results only).
# What a thunk TU exports and the shell reads. `Value` stays opaque here, so a facade-mode thunk
# TU (facade_lib.py) declares the same table without any torch header.
THUNK_ABI_HEADER = r"""// Kiln thunk ABI: the binding table (thunks.py)
#ifndef KILN_THUNK_ABI_H
#define KILN_THUNK_ABI_H
namespace kiln {

struct Value;  // one argument or result (kiln_thunk.h)
using Call = void (*)(Value* args, Value* result);

struct Binding {
  const char* name;
  const char* doc;
  const char* signature;  // argument codes, ':', result code ("TTd:T")
  Call call;
  bool error_handling;  // load_inline's with_pytorch_error_handling
};

}  // namespace kiln

extern "C" const kiln::Binding* kiln_bindings(int* count);
#endif
"""

# The call machinery both thunk headers share: how a bound function becomes a type-erased call and a
# signature string. Each header supplies a `Values` policy: how to reach argument k, convert a type
# (`Values::Conv<T>`: code(), get(Value*), put(Value*, T)), mark a void result and make a tuple.
THUNK_CALLS_HEADER = r"""// Kiln thunk calls: type-erased calls over kiln::Value, for both thunk headers (thunks.py)
#ifndef KILN_THUNK_CALLS_H
#define KILN_THUNK_CALLS_H
#include "kiln_thunk_abi.h"
#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace kiln {
namespace calls {

template <typename T> using Plain = std::remove_cv_t<std::remove_reference_t<T>>;

template <typename Values, typename R> std::string result_code() {
  if constexpr (std::is_void_v<R>) {
    return "v";
  } else {
    return Values::template Conv<Plain<R>>::code();
  }
}

// A tuple result ("(Tl)"): the Values' Conv<std::tuple<...>> derives from this.
template <typename Values, typename... Ts> struct TupleResult {
  static std::string code() { return "(" + (std::string() + ... + Values::template Conv<Ts>::code()) + ")"; }
  static void put(Value* v, std::tuple<Ts...> x) {
    put_each(Values::put_tuple(v, sizeof...(Ts)), std::move(x), std::index_sequence_for<Ts...>{});
  }
  template <size_t... I>
  static void put_each(Value* first, std::tuple<Ts...>&& x, std::index_sequence<I...>) {
    (Values::template Conv<Ts>::put(Values::item(first, I), std::move(std::get<I>(x))), ...);
  }
};

template <typename Values, typename R, typename... A>
struct FnTraits {
  static const char* signature() {
    static const std::string s =
        (std::string() + ... + Values::template Conv<Plain<A>>::code()) + ":" + result_code<Values, R>();
    return s.c_str();
  }
  template <typename F, size_t... I>
  static void invoke(F f, Value* in, Value* out, std::index_sequence<I...>) {
    std::tuple<Plain<A>...> args{Values::template Conv<Plain<A>>::get(Values::item(in, I))...};
    if constexpr (std::is_void_v<R>) {
      f(std::get<I>(args)...);
      Values::put_void(out);
    } else {
      Values::template Conv<Plain<R>>::put(out, f(std::get<I>(args)...));
    }
  }
};

template <typename Values, typename Sig> struct Fn;
template <typename Values, typename R, typename... A> struct Fn<Values, R (*)(A...)> : FnTraits<Values, R, A...> {
  template <R (*F)(A...)> static void call(Value* in, Value* out) {
    FnTraits<Values, R, A...>::invoke(F, in, out, std::index_sequence_for<A...>{});
  }
};
template <typename Values, typename R, typename... A>
struct Fn<Values, R (*)(A...) noexcept> : FnTraits<Values, R, A...> {
  template <R (*F)(A...) noexcept> static void call(Value* in, Value* out) {
    FnTraits<Values, R, A...>::invoke(F, in, out, std::index_sequence_for<A...>{});
  }
};

}  // namespace calls
}  // namespace kiln
#endif
"""

THUNK_HEADER = r"""// Kiln thunk ABI: shared by per-signature thunk TUs and the module shell
#ifndef KILN_THUNK_H
#define KILN_THUNK_H
#include "kiln_thunk_abi.h"
#include "kiln_thunk_calls.h"
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace kiln {

struct Extra;

// One argument or result. The common types live inline; the rest in `Extra`, allocated only
// when used, so the per-call cost of a Value is that of an undefined Tensor.
struct Value {
  char code = 'v';
  at::Tensor t;
  int64_t i = 0;
  double d = 0.0;
  bool b = false;
  std::unique_ptr<Extra> x;

  Value() = default;
  Value(Value&&) = default;
  Value& operator=(Value&&) = default;
  ~Value();
  Extra& extra();
};

struct Extra {
  std::vector<at::Tensor> tl;
  std::optional<at::Tensor> ot;
  std::vector<int64_t> il;
  std::string s;
  std::vector<Value> tuple;
};

inline Value::~Value() = default;
inline Extra& Value::extra() {
  if (!x) x = std::make_unique<Extra>();
  return *x;
}

template <typename T> struct Conv;  // no specialisation: the type is not supported by thunks

#define KILN_SCALAR_CONV(TYPE, CODE, FIELD)                                  \
  template <> struct Conv<TYPE> {                                            \
    static std::string code() { return CODE; }                               \
    static TYPE get(Value* v) { return static_cast<TYPE>(v->FIELD); }        \
    static void put(Value* v, TYPE x) { v->code = CODE[0]; v->FIELD = x; }   \
  };
KILN_SCALAR_CONV(long, "l", i)
KILN_SCALAR_CONV(long long, "q", i)
KILN_SCALAR_CONV(int, "i", i)
KILN_SCALAR_CONV(double, "d", d)
KILN_SCALAR_CONV(float, "f", d)
KILN_SCALAR_CONV(bool, "b", b)
#undef KILN_SCALAR_CONV

template <> struct Conv<at::Tensor> {
  static std::string code() { return "T"; }
  static at::Tensor get(Value* v) { return std::move(v->t); }
  static void put(Value* v, at::Tensor x) { v->code = 'T'; v->t = std::move(x); }
};

#define KILN_EXTRA_CONV(TYPE, CODE, FIELD)                                   \
  template <> struct Conv<TYPE> {                                            \
    static std::string code() { return CODE; }                               \
    static TYPE get(Value* v) { return std::move(v->extra().FIELD); }        \
    static void put(Value* v, TYPE x) { v->code = CODE[0]; v->extra().FIELD = std::move(x); } \
  };
KILN_EXTRA_CONV(std::vector<at::Tensor>, "L", tl)
KILN_EXTRA_CONV(std::optional<at::Tensor>, "O", ot)
KILN_EXTRA_CONV(std::vector<int64_t>, "I", il)
KILN_EXTRA_CONV(std::string, "s", s)
#undef KILN_EXTRA_CONV

template <> struct Conv<c10::IntArrayRef> {  // argument only: it views the Value's storage
  static std::string code() { return "A"; }
  static c10::IntArrayRef get(Value* v) { return c10::IntArrayRef(v->extra().il); }
};

struct AtenValues;
template <typename... Ts> struct Conv<std::tuple<Ts...>> : calls::TupleResult<AtenValues, Ts...> {};  // result only

// The Values policy of kiln::calls over the complete Value.
struct AtenValues {
  template <typename T> using Conv = ::kiln::Conv<T>;
  static Value* item(Value* values, size_t k) { return values + k; }
  static void put_void(Value* v) { v->code = 'v'; }
  static Value* put_tuple(Value* v, size_t n) {
    v->code = '(';
    v->extra().tuple.resize(n);
    return v->extra().tuple.data();
  }
};

template <typename Sig> using Fn = calls::Fn<AtenValues, Sig>;

}  // namespace kiln
#endif
"""

# The facade-mode thunk ABI: what a thunk TU for a facade-built CUDA unit includes instead of the
# lean prelude and kiln_thunk.h. `kiln::Value` stays opaque; the accessors that move values in and
# out of it live in the facade library (facade_lib.py, compiled against ATen once), so the
# per-candidate TU parses the facade header and a few standard headers only. The type codes are
# kiln_thunk.h's.
FACADE_THUNK_HEADER = r"""// Kiln facade thunk ABI: thunk TUs for facade-built CUDA units, no torch header (thunks.py)
#ifndef KILN_FACADE_THUNK_H
#define KILN_FACADE_THUNK_H
#include "kiln_thunk_abi.h"
#include "kiln_thunk_calls.h"
#include "kiln_facade.h"
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace kiln {
namespace fc {
namespace thunk {

// Implemented in the facade library, against the real kiln::Value (kiln_thunk.h).
Value* item(Value* values, size_t k);  // values[k]
Tensor take_tensor(Value* v);
int64_t get_int(Value* v);
double get_double(Value* v);
bool get_bool(Value* v);
std::vector<Tensor> take_tensors(Value* v);
std::vector<int64_t> take_ints(Value* v);
void put_tensor(Value* v, Tensor x);
void put_int(Value* v, char code, int64_t x);
void put_double(Value* v, char code, double x);
void put_bool(Value* v, bool x);
void put_tensors(Value* v, std::vector<Tensor> x);
void put_ints(Value* v, std::vector<int64_t> x);
void put_void(Value* v);
Value* put_tuple(Value* v, size_t n);  // makes v a tuple of n values; returns the first

template <typename T> struct Conv;  // no specialisation: the type is not carried (the build falls back)

#define KILN_FC_CONV(TYPE, CODE, GET, PUT)                                   \
  template <> struct Conv<TYPE> {                                            \
    static std::string code() { return CODE; }                               \
    static TYPE get(Value* v) { return static_cast<TYPE>(GET(v)); }          \
    static void put(Value* v, TYPE x) { PUT; }                               \
  };
KILN_FC_CONV(long, "l", get_int, put_int(v, 'l', x))
KILN_FC_CONV(long long, "q", get_int, put_int(v, 'q', x))
KILN_FC_CONV(int, "i", get_int, put_int(v, 'i', x))
KILN_FC_CONV(double, "d", get_double, put_double(v, 'd', x))
KILN_FC_CONV(float, "f", get_double, put_double(v, 'f', x))
KILN_FC_CONV(bool, "b", get_bool, put_bool(v, x))
KILN_FC_CONV(Tensor, "T", take_tensor, put_tensor(v, std::move(x)))
KILN_FC_CONV(std::vector<Tensor>, "L", take_tensors, put_tensors(v, std::move(x)))
KILN_FC_CONV(std::vector<int64_t>, "I", take_ints, put_ints(v, std::move(x)))
#undef KILN_FC_CONV

struct FacadeValues;
template <typename... Ts> struct Conv<std::tuple<Ts...>> : ::kiln::calls::TupleResult<FacadeValues, Ts...> {};

// The Values policy of kiln::calls over the opaque Value, through the library's accessors.
struct FacadeValues {
  template <typename T> using Conv = ::kiln::fc::thunk::Conv<T>;
  static Value* item(Value* values, size_t k) { return ::kiln::fc::thunk::item(values, k); }
  static void put_void(Value* v) { ::kiln::fc::thunk::put_void(v); }
  static Value* put_tuple(Value* v, size_t n) { return ::kiln::fc::thunk::put_tuple(v, n); }
};

template <typename Sig> using Fn = ::kiln::calls::Fn<FacadeValues, Sig>;

}  // namespace thunk
}  // namespace fc
}  // namespace kiln
#endif
"""

SHELL_SOURCE = r"""// Kiln module shell: the one PYBIND11_MODULE every thunk-bound extension links (see thunks.py)
#include "binding.h"
#include "kiln_thunk.h"
#include <sstream>

namespace py = pybind11;
namespace {

template <typename T> bool load_as(py::handle h, T& out) {
  py::detail::make_caster<T> caster;
  if (!caster.load(h, /*convert=*/true)) return false;
  out = py::detail::cast_op<T>(std::move(caster));
  return true;
}

bool load(char code, py::handle h, kiln::Value& v) {
  v.code = code;
  switch (code) {
    case 'T': return load_as(h, v.t);
    case 'l': { long x; if (!load_as(h, x)) return false; v.i = x; return true; }
    case 'q': { long long x; if (!load_as(h, x)) return false; v.i = x; return true; }
    case 'i': { int x; if (!load_as(h, x)) return false; v.i = x; return true; }
    case 'd': return load_as(h, v.d);
    case 'f': { float x; if (!load_as(h, x)) return false; v.d = x; return true; }
    case 'b': return load_as(h, v.b);
    case 'L': return load_as(h, v.extra().tl);
    case 'O': return load_as(h, v.extra().ot);
    case 'I': return load_as(h, v.extra().il);
    case 'A': {
      py::detail::make_caster<c10::IntArrayRef> caster;
      if (!caster.load(h, true)) return false;
      c10::IntArrayRef ref = py::detail::cast_op<c10::IntArrayRef>(caster);
      v.extra().il.assign(ref.begin(), ref.end());
      return true;
    }
    case 's': return load_as(h, v.extra().s);
  }
  return false;
}

template <typename T> py::object cast_back(T&& x) {
  return py::reinterpret_steal<py::object>(
      py::detail::make_caster<T>::cast(std::forward<T>(x), py::return_value_policy::move, py::handle()));
}

py::object result(kiln::Value& v) {
  switch (v.code) {
    case 'T': return cast_back(std::move(v.t));
    case 'l': case 'q': case 'i': return cast_back(static_cast<long long>(v.i));
    case 'd': case 'f': return cast_back(v.d);
    case 'b': return cast_back(v.b);
    case 'L': return cast_back(std::move(v.extra().tl));
    case 'O': return cast_back(std::move(v.extra().ot));
    case 'I': return cast_back(std::move(v.extra().il));
    case 's': return cast_back(std::move(v.extra().s));
    case '(': {
      std::vector<kiln::Value>& items = v.extra().tuple;
      py::tuple t(items.size());
      for (size_t k = 0; k < items.size(); ++k) t[k] = result(items[k]);
      return std::move(t);
    }
  }
  return py::none();
}

const char* type_name(char code) {
  switch (code) {
    case 'T': return "torch.Tensor";
    case 'l': case 'q': case 'i': return "int";
    case 'd': case 'f': return "float";
    case 'b': return "bool";
    case 'L': return "list[torch.Tensor]";
    case 'O': return "Optional[torch.Tensor]";
    case 'I': case 'A': return "list[int]";
    case 's': return "str";
  }
  return "object";
}

// pybind11's wording, so feedback reads the same as with a load_inline-generated binding.
[[noreturn]] void incompatible(const kiln::Binding& b, const std::string& args, const py::handle* got, size_t n) {
  std::ostringstream msg;
  msg << b.name << "(): incompatible function arguments. The following argument types are supported:\n    1. (";
  for (size_t k = 0; k < args.size(); ++k) msg << (k ? ", " : "") << "arg" << k << ": " << type_name(args[k]);
  const std::string result = std::string(b.signature).substr(args.size() + 1);
  msg << ") -> " << (result == "v" ? "None" : result[0] == '(' ? "tuple" : type_name(result[0])) << "\n\nInvoked with: ";
  for (size_t k = 0; k < n; ++k) msg << (k ? ", " : "") << py::repr(got[k]).cast<std::string>();
  throw py::type_error(msg.str());
}

// Arguments live on the stack; only as many Values as the function takes are constructed.
class Args {
 public:
  explicit Args(size_t n) : n_(n) {
    for (size_t k = 0; k < n_; ++k) new (&data()[k]) kiln::Value();
  }
  ~Args() {
    for (size_t k = 0; k < n_; ++k) data()[k].~Value();
  }
  kiln::Value* data() { return reinterpret_cast<kiln::Value*>(buf_); }
  static constexpr size_t kMax = 24;

 private:
  size_t n_;
  alignas(kiln::Value) unsigned char buf_[kMax * sizeof(kiln::Value)];
};

py::object dispatch(const kiln::Binding& b, const std::string& args, const py::handle* got, size_t n) {
  if (n != args.size() || n > Args::kMax) incompatible(b, args, got, n);
  Args in(n);
  for (size_t k = 0; k < n; ++k) {
    if (!load(args[k], got[k], in.data()[k])) incompatible(b, args, got, n);
  }
  kiln::Value out;
  b.call(in.data(), &out);
  return result(out);
}

template <typename F> void def(py::module_& m, const kiln::Binding* b, F f) {
  if (b->error_handling) {
    m.def(b->name, torch::wrap_pybind_function(f), b->doc);
  } else {
    m.def(b->name, f, b->doc);
  }
}

template <size_t I> using Handle = py::handle;

// A fixed-arity overload (no argument tuple to build: the common call path), then a *args one
// that only runs when the first does not match, to say what was expected.
template <size_t... I>
void def_binding(py::module_& m, const kiln::Binding* b, const std::string& args, std::index_sequence<I...>) {
  def(m, b, [b, args](Handle<I>... h) {
    const py::handle got[] = {h..., py::handle()};
    return dispatch(*b, args, got, sizeof...(I));
  });
  def(m, b, [b, args](py::args got) {
    std::vector<py::handle> hs(got.begin(), got.end());
    return dispatch(*b, args, hs.data(), hs.size());
  });
}

template <size_t N = 0>
void def_any(py::module_& m, const kiln::Binding* b, const std::string& args) {
  if constexpr (N <= Args::kMax) {
    if (args.size() == N) return def_binding(m, b, args, std::make_index_sequence<N>{});
    def_any<N + 1>(m, b, args);
  } else {
    throw std::runtime_error(std::string(b->name) + ": too many arguments for a thunk binding");
  }
}

}  // namespace

PYBIND11_MODULE(kiln_ext, m) {
  int count = 0;
  const kiln::Binding* table = kiln_bindings(&count);
  for (int k = 0; k < count; ++k) {
    const kiln::Binding* b = &table[k];
    const std::string sig = b->signature;
    def_any(m, b, sig.substr(0, sig.find(':')));
  }
}
"""


def thunk_source(
    preamble: tuple[str, ...],
    declarations: list[str],
    functions: tuple[str, ...],
    docstrings: tuple[str, ...],
    error_handling: bool,
    facade: bool = False,
) -> str:
    """The per-signature thunk TU body (after its headers are included).

    Without `facade`, the lean prelude and kiln_thunk.h come first. With `facade`, the functions
    were compiled against the CUDA facade (facade.py), `declarations` spell their tensors as
    `::kiln::fc::Tensor`, and the TU includes only kiln_facade_thunk.h (facade_lib.py): its
    `kiln::fc::thunk::Fn` builds the same table through the facade library's accessors, so the TU
    parses no torch header at all."""
    fn_template = "kiln::fc::thunk::Fn" if facade else "kiln::Fn"
    rows = []
    # Not strict: a spec read back from the sandbox is not checked for alignment; bind what pairs, as ever.
    for name, doc in zip(functions, docstrings or functions, strict=False):
        fn = f"{fn_template}<decltype(&{name})>"
        rows.append(
            f"    {{{json.dumps(name)}, {json.dumps(doc)}, {fn}::signature(), &{fn}::template call<&{name}>, "
            f"{'true' if error_handling else 'false'}}},"
        )
    # The table's own names are ones no candidate function takes: a bound function named `count` or
    # `table` would otherwise be the parameter or the array inside the initializer.
    return "\n".join(
        [
            *preamble,
            *declarations,
            'extern "C" const kiln::Binding* kiln_bindings(int* kiln_binding_count) {',
            "  static const kiln::Binding kiln_binding_table[] = {",
            *rows,
            "  };",
            "  *kiln_binding_count = static_cast<int>(sizeof(kiln_binding_table) / sizeof(kiln_binding_table[0]));",
            "  return kiln_binding_table;",
            "}",
        ]
    )
