// Checks that every rank holds the same thing (bucket layout, configuration, replica weights) by
// comparing hashes (Note [Consensus by hashes] in rank_consensus.cpp), and makes rank 0's module
// state everyone's. Each function taking a group is a collective: every rank of the group must
// call it, in the same order.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "collectives/process_group.h"
#include "models/module.h"

namespace mtrain {

// 64-bit FNV-1a, chainable through `seed`.
uint64_t fnv1a(const void* data, size_t bytes, uint64_t seed = 14695981039346656037ull);
uint64_t fnv1a(const std::string& text, uint64_t seed = 14695981039346656037ull);

struct NamedHash {
  std::string name;  // what it stands for in messages, e.g. "--sync-bn"
  uint64_t hash = 0;
  std::string local_value;  // this rank's value for the message; may be empty
};

// Collective: the sum of every rank's `value` in double precision, the same on every
// rank (the values travel as their bits and are added in rank order). The epoch's loss
// sums go through it: a float32 all-reduce would round them to 7 digits, so a resumed
// run's epoch loss would differ from the uninterrupted run's.
double sum_over_ranks(ProcessGroup& group, double value);

// All-gathers `items` (the same names, in the same order, on every rank) and throws
// InvalidArgument "<what> differs across ranks: <name> on ranks 1, 3 differs from
// rank 0 (here: <value>); ..." when any hash differs from rank 0's.
void require_same_on_all_ranks(ProcessGroup& group, const std::vector<NamedHash>& items,
                               const std::string& what);

// Hash of every parameter value (names, shapes and bytes), in parameter order. GPU
// parameters are copied to the host to be hashed.
uint64_t hash_parameters(models::Module& model);

// Overwrites every parameter and buffer with rank 0's (one flat broadcast per dtype).
// The tensors of one dtype must share a device, the group's: pass the gradient group
// for a model on a GPU (Note [Control-plane collectives] in training_groups.cpp).
void broadcast_module_state(ProcessGroup& group, models::Module& model);

// The buffers alone (BatchNorm's running statistics): DDP's broadcast_buffers (Note
// [Buffers follow rank 0] in train_loop.cpp).
void broadcast_module_buffers(ProcessGroup& group, models::Module& model);

}  // namespace mtrain
