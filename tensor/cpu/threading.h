// Intra-op thread control shared by the OpenMP loops and oneDNN.
#pragma once

namespace mtrain::ops::cpu {

// Applies ops::num_threads() to the calling thread's OpenMP setting, which oneDNN reads
// too (Note [Thread count] in threading.cpp). Kernels call it before they run
// parallel code.
void use_configured_threads();

}  // namespace mtrain::ops::cpu
