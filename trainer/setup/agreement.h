// What the ranks of a run, and a run and the checkpoint it resumes, must agree on: pure functions
// of the options and the data, the same on every rank that runs the same configuration.
#pragma once

#include <string>
#include <vector>

#include "data/dataset.h"
#include "tensor/tensor.h"
#include "trainer/checkpoint/checkpoint_file.h"
#include "trainer/ddp/rank_consensus.h"
#include "trainer/options.h"

namespace mtrain {

// FNV-1a of the training set's labels and pixels, as 16 hex digits: the same size from
// other files (another dataset directory on one node, another copy after a resume)
// changes it. Reads every byte of the set once.
std::string dataset_fingerprint(const data::Dataset& dataset);

// Every flag that changes what is trained or how the ranks cooperate, hashed for the
// start-up check that every rank runs the same (Note [Consensus by hashes]); paths and
// logging flags may differ per rank. `fingerprint` is dataset_fingerprint of the training set.
std::vector<NamedHash> training_configuration(const TrainOptions& options, int64_t train_size,
                                              const std::string& fingerprint, const Device& device);

// What a checkpoint must have been written under to be resumed by this run: every
// setting that changes the sequence of updates (Note [What a resume must match] in
// agreement.cpp).
RunConfiguration resume_configuration(const TrainOptions& options, int64_t train_size,
                                      const std::string& fingerprint);

}  // namespace mtrain
