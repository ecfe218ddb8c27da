// Typed errors for library code. `main` catches mtrain::Error and prints its
// message as one line on stderr with a non-zero exit (see core/main_guard.h).
//
// Note [Error messages]
// ~~~~~~~~~~~~~~~~~~~~~
// Every message says what was expected, what was found and, where it helps, what
// to do: "IDX file data/x.gz: expected magic 0x00000803 (images), found 0x00000801".
// Library code throws; it never prints and exits.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace mtrain {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad user input: CLI flags, environment variables, configuration.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// Files and data: missing, truncated, corrupt, wrong format.
class IoError : public Error {
 public:
  using Error::Error;
};

// Something did not happen in time; the message names what was waited for.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// An allocator could not get memory even after returning its cache; the message says
// what was asked for and what is held.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

// Network / peer / collective failures.
class CommError : public Error {
 public:
  using Error::Error;
};

// A broken invariant inside mtrain (a bug, not bad input).
class InternalError : public Error {
 public:
  using Error::Error;
};

}  // namespace mtrain

// MTRAIN_CHECK(cond, "fmt {}", args...): throws InternalError naming the file and line.
// Use a typed throw (InvalidArgument, IoError, ...) for anything a user can cause.
#define MTRAIN_CHECK(cond, ...)                                                        \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      throw ::mtrain::InternalError(::fmt::format("{}:{}: check '{}' failed: {}",      \
                                                  __FILE__, __LINE__, #cond,           \
                                                  ::fmt::format(__VA_ARGS__)));        \
    }                                                                                  \
  } while (0)
