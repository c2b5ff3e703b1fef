// Internal error reporting: a status plus a per-thread message; no exception crosses the C ABI.
#pragma once
#include <cstdarg>
#include <exception>
#include <new>
#include <string>

#include "fusedce/fusedce.h"

namespace fce {

// Thrown inside the library, caught at every entry point by guard().
struct Error {
  fce_status_t status;
  std::string message;
};

[[noreturn]] void raise(fce_status_t status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void set_error_message(const std::string& msg);
void clear_error();

// The handle an entry point holds (check_handle took its busy flag), given back when the entry point returns,
// whatever the path; one per guard() on the calling thread, linked to the scope of the entry point this
// thread is inside, if any (so that an entry point calling another one on its handle does not find it busy).
class HandleScope {
 public:
  HandleScope() noexcept;
  ~HandleScope();
  HandleScope(const HandleScope&) = delete;
  HandleScope& operator=(const HandleScope&) = delete;
  fce_handle* held = nullptr;
  HandleScope* const outer;
};

#define FCE_CHECK(cond, status, ...)          \
  do {                                        \
    if (!(cond)) ::fce::raise(status, __VA_ARGS__); \
  } while (0)

// Runs an entry point's body, converting every failure into a status and a thread-local message.
template <class F>
fce_status_t guard(const char* fn, F&& body) noexcept {
  clear_error();
  HandleScope scope;
  try {
    body();
    return FCE_STATUS_SUCCESS;
  } catch (const Error& e) {
    set_error_message(std::string(fn) + ": " + e.message);
    return e.status;
  } catch (const std::bad_alloc&) {
    set_error_message(std::string(fn) + ": out of host memory");
    return FCE_STATUS_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_error_message(std::string(fn) + ": internal error: " + e.what());
    return FCE_STATUS_INTERNAL_ERROR;
  } catch (...) {
    set_error_message(std::string(fn) + ": internal error");
    return FCE_STATUS_INTERNAL_ERROR;
  }
}

}  // namespace fce
