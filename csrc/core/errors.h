// Exception hierarchy of the core. Each class maps to one Python exception in colomem.errors
// (bindings/errors.cpp); messages say what happened and what to do about it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace colomem {

template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
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
