// Exception hierarchy of the core. Each class maps to one Python exception in colomem.errors
// (bindings/errors.cpp); messages say what happened and what to do about it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <stdexcept>
#include <string>
#include <utility>

namespace colomem {

// An address printed as 0x... in messages: cat("at ", hex(ptr)).
struct Hex {
  uintptr_t value;
};
inline Hex hex(uintptr_t v) { return Hex{v}; }

// Message building without iostreams: no locale facets are touched, so the core never depends on
// how (or by which libstdc++ copy) the process's global locale was set up.
namespace detail {
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void append(std::string& s, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.4g", v);
  s += buf;
}
inline void append(std::string& s, Hex v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v.value));
  s += buf;
}
inline void append(std::string& s, float v) { append(s, static_cast<double>(v)); }
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
}  // namespace detail

template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

#define COLOMEM_DEFINE_ERROR(Name, Base) \
  class Name : public Base {             \
   public:                               \
    explicit Name(const std::string& msg) : Base(msg) {} \
  };

COLOMEM_DEFINE_ERROR(InvalidArgument, Error)
COLOMEM_DEFINE_ERROR(PoolExhausted, Error)
COLOMEM_DEFINE_ERROR(DoubleRelease, Error)
COLOMEM_DEFINE_ERROR(PoolClosed, Error)
COLOMEM_DEFINE_ERROR(PoolBusy, Error)
COLOMEM_DEFINE_ERROR(Timeout, Error)
COLOMEM_DEFINE_ERROR(NotAvailable, Error)
COLOMEM_DEFINE_ERROR(PeerError, Error)
#undef COLOMEM_DEFINE_ERROR

// A failed CUDA runtime or driver call. `status` is the numeric cudaError_t / CUresult.
class CudaError : public Error {
 public:
  CudaError(const std::string& msg, int status, std::string status_name)
      : Error(msg), status_(status), status_name_(std::move(status_name)) {}
  int status() const { return status_; }
  const std::string& status_name() const { return status_name_; }

 private:
  int status_;
  std::string status_name_;
};

class CudaOutOfMemory : public CudaError {
 public:
  using CudaError::CudaError;
};

// Throws InvalidArgument with the message when cond is false.
inline void require(bool cond, const std::string& msg) {
  if (!cond) throw InvalidArgument(msg);
}

// Destructors must not throw: they report here (stderr, once per call) and carry on.
void warn(const std::string& msg);

}  // namespace colomem
