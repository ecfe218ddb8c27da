// Where a run's data comes from: the --dataset / --data-dir rules of mtrain-train (Note [Dataset
// resolution] in data_source.cpp). --data-dir wins; else a full set under data/ wins over the
// shipped mini set, "data/" being looked for in the current directory, then beside the
// executable's build tree. The chosen source comes with one log sentence saying why.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/image_folder.h"
#include "data/synthetic.h"
#include "data/webdataset.h"

namespace mtrain::data {

struct DataSource {
  std::string dataset;         // one of known_datasets()
  std::filesystem::path dir;   // empty for synthetic
  std::string description;     // one sentence for the log
};

// fashion-mnist, mnist, cifar10, cifar100, imagefolder, webdataset, synthetic
const std::vector<std::string>& known_datasets();

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
// The files `dataset` reads that `dir` lacks (IDX or CIFAR); empty when it is complete.
std::vector<std::string> missing_dataset_files(const std::string& dataset, const std::filesystem::path& dir);
// What a directory of `dataset` must hold, for messages: "the four mnist IDX files".
std::string expected_files(const std::string& dataset);

// Loads the train and test splits `source` names; `synthetic` sizes and seeds the
// synthetic dataset and is ignored otherwise. `folder` applies to --dataset imagefolder
// (and its flags to webdataset: require_folder_options_apply), `shards` to webdataset and
// to an image folder it streams.
DatasetSplits load_splits(const DataSource& source, const SyntheticOptions& synthetic,
                          const ImageFolderOptions& folder = {}, const StreamedSplitsOptions& shards = {});

// InvalidArgument naming the flag when `folder` asks for anything (--skip-bad-images,
// --resize) and `dataset` is neither imagefolder nor webdataset.
void require_folder_options_apply(const std::string& dataset, const ImageFolderOptions& folder);

}  // namespace mtrain::data
