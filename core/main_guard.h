// run_main(fn): the one place where exceptions become "program: message" on stderr
// and a non-zero exit status (2 for bad input, 1 for everything else).
#pragma once

#include <cstdio>
#include <exception>

#include "core/error.h"

namespace mtrain {

template <class Fn>
int run_main(const char* program, Fn&& fn) {
  try {
    return fn();
  } catch (const InvalidArgument& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", program, e.what());
    return 1;
  }
}

}  // namespace mtrain
