// Where a run's data comes from: the --dataset / --data-dir rules of mtrain-train.
//
// Note [Dataset resolution]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// * --data-dir given: that directory, which must hold the four IDX files (official
//   names, .gz or raw); the error lists the missing ones.
// * fashion-mnist: data/fashion-mnist when it holds all four files (the full set from
//   scripts/get-data.sh), else the shipped data/fashion-mnist-mini, so a fresh checkout
//   trains out of the box. The log sentence says which one was taken and why.
// * mnist: data/mnist, else an error saying to run scripts/get-data.sh mnist or pass
//   --data-dir (nothing ships for MNIST).
// * synthetic: generated from the seed, no directory (and --data-dir is an error).
// "data/" is looked for in the current directory first, then at <exe dir>/../../data
// (build/bin/../../data is the project's data/), so `./build/bin/mtrain-train` works from
// the project root and from anywhere else. A full set in either place wins over the
// mini set in either place.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/synthetic.h"

namespace mtrain::data {

struct DataSource {
  std::string dataset;         // "fashion-mnist", "mnist" or "synthetic"
  std::filesystem::path dir;   // empty for synthetic
  std::string description;     // one sentence for the log
};

const std::vector<std::string>& known_datasets();  // fashion-mnist, mnist, synthetic

// Throws InvalidArgument for an unknown dataset (or --data-dir with synthetic) and
// IoError when no directory with the files is found.
DataSource resolve_data_dir(const std::string& dataset, const std::string& data_dir_flag);
// The same with the "data/" directories to search given explicitly, in order.
DataSource resolve_data_dir(const std::string& dataset, const std::string& data_dir_flag,
                            const std::vector<std::filesystem::path>& data_roots);

// ./data, then <dir of /proc/self/exe>/../../data (when the link can be read).
std::vector<std::filesystem::path> default_data_roots();

// The four IDX stems (with "[.gz]") missing from `dir`; empty when it is complete.
std::vector<std::string> missing_idx_files(const std::filesystem::path& dir);

// Loads the train and test splits `source` names; `synthetic` sizes and seeds the
// synthetic dataset and is ignored otherwise.
DatasetSplits load_splits(const DataSource& source, const SyntheticOptions& synthetic);

}  // namespace mtrain::data
