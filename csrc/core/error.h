// Error reporting for the whole C++ side: every failed check names file:line, the condition and a
// message that says what is wrong and what to do. Bindings translate these to Python exceptions:
// ArgumentError -> ValueError, Error -> RuntimeError.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace asyncpp {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct ArgumentError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
template <typename E>
[[noreturn]] inline void fail(const char* file, int line, const char* cond, const std::string& msg) {
  const char* base = file;
  for (const char* p = file; *p; ++p)
    if (*p == '/') base = p + 1;
  throw E(concat(msg, " [", base, ":", line, ": ", cond, "]"));
}
}  // namespace detail
}  // namespace asyncpp

// Internal invariant or runtime failure (RuntimeError in Python).
#define ASYNCPP_CHECK(cond, ...)                                                              \
  do {                                                                                        \
    if (!(cond))                                                                              \
      ::asyncpp::detail::fail<::asyncpp::Error>(__FILE__, __LINE__, #cond,                    \
                                                ::asyncpp::detail::concat(__VA_ARGS__));      \
  } while (0)

// Bad input from the caller (ValueError in Python).
#define ASYNCPP_ARG_CHECK(cond, ...)                                                          \
  do {                                                                                        \
    if (!(cond))                                                                              \
      ::asyncpp::detail::fail<::asyncpp::ArgumentError>(__FILE__, __LINE__, #cond,            \
                                                        ::asyncpp::detail::concat(__VA_ARGS__)); \
  } while (0)
