#include "data/data_source.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/error.h"
#include "data/cifar_reader.h"
#include "data/idx_reader.h"
#include "data/image_folder.h"
#include "data/webdataset.h"

// Note [Dataset resolution]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// * --data-dir given: that directory, which must hold the four IDX files (official names, .gz or
//   raw); the error lists the missing ones.
// * fashion-mnist: data/fashion-mnist when it holds all four files (the full set from
//   scripts/get-data.sh), else the shipped data/fashion-mnist-mini, so a fresh checkout trains out
//   of the box. The log sentence says which one was taken and why.
// * mnist: data/mnist, else an error saying to run scripts/get-data.sh mnist or pass --data-dir
//   (nothing ships for MNIST).
// * cifar10, cifar100: the binary batches (Note in data/cifar_reader.h), from --data-dir,
//   data/<dataset> or the folder the official archive unpacks to (data/cifar-10-batches-bin,
//   data/cifar-100-binary); nothing ships for either.
// * imagefolder: --data-dir only, holding train/ and val/ (data/image_folder.h).
// * webdataset: --data-dir only, a folder holding train/ (and val/) shards, a folder of
//   shards or a shard pattern, read when the splits load (data/webdataset.h).
// * synthetic: generated from the seed, no directory (and --data-dir is an error).
// "data/" is looked for in the current directory first, then at <exe dir>/../../data
// (build/bin/../../data is the project's data/), then at <exe dir>/../share/mtrain/data (where
// `cmake --install` puts the shipped set), so `./build/bin/mtrain-train` and an installed
// mtrain-train work from the project root and from anywhere else. A full set in either place wins over the mini set in either
// place.

namespace mtrain::data {
namespace {

namespace fs = std::filesystem;

constexpr const char* kMiniDir = "fashion-mnist-mini";

std::string display(const fs::path& p) { return p.lexically_normal().string(); }

std::string roots_str(const std::vector<fs::path>& roots) {
  std::vector<std::string> shown;
  for (const fs::path& r : roots) shown.push_back(display(r));
  return fmt::format("{}", fmt::join(shown, " and "));
}

}  // namespace

const std::vector<std::string>& known_datasets() {
  static const std::vector<std::string> names = {"fashion-mnist", "mnist", "cifar10", "cifar100", "imagefolder",
                                                 "webdataset", "synthetic"};
  return names;
}

std::vector<std::string> missing_idx_files(const fs::path& dir) {
  std::vector<std::string> missing;
  for (const std::string& stem : idx_file_stems()) {
    if (!find_idx_file(dir, stem)) missing.push_back(stem + "[.gz]");
  }
  return missing;
}

std::vector<std::string> missing_dataset_files(const std::string& dataset, const fs::path& dir) {
  if (is_cifar(dataset)) return missing_cifar_files(dir, cifar_format(dataset));
  if (dataset == "imagefolder") {
    std::vector<std::string> missing;
    std::error_code ec;
    for (const char* split : {kImageFolderTrain, kImageFolderVal}) {
      if (!fs::is_directory(dir / split, ec)) missing.push_back(std::string(split) + "/");
    }
    return missing;
  }
  return missing_idx_files(dir);
}

std::string expected_files(const std::string& dataset) {
  if (dataset == "imagefolder") return "train/ and val/ folders, each with one subfolder of images per class";
  if (!is_cifar(dataset)) return fmt::format("the four {} IDX files", dataset);
  const CifarFormat& f = cifar_format(dataset);
  return fmt::format("{}'s binary files ({}, {})", dataset, fmt::join(f.train_files, ", "),
                     fmt::join(f.test_files, ", "));
}

std::vector<fs::path> default_data_roots() {
  std::vector<fs::path> roots = {fs::current_path() / "data"};
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    // build/bin/../../data in a checkout; <prefix>/bin/../share/mtrain/data once installed.
    for (const fs::path& candidate : {exe.parent_path() / ".." / ".." / "data",
                                      exe.parent_path() / ".." / "share" / "mtrain" / "data"}) {
      const fs::path root = candidate.lexically_normal();
      if (std::find(roots.begin(), roots.end(), root) == roots.end()) roots.push_back(root);
    }
  }
  return roots;
}

DataSource resolve_data_dir(const std::string& dataset, const std::string& data_dir_flag) {
  return resolve_data_dir(dataset, data_dir_flag, default_data_roots());
}

DataSource resolve_data_dir(const std::string& dataset, const std::string& data_dir_flag,
                            const std::vector<fs::path>& data_roots) {
  const auto& known = known_datasets();
  if (std::find(known.begin(), known.end(), dataset) == known.end()) {
    throw InvalidArgument(fmt::format("--dataset: expected one of {}, found '{}'",
                                      fmt::join(known, ", "), dataset));
  }
  if (dataset == "synthetic") {
    if (!data_dir_flag.empty()) {
      throw InvalidArgument(fmt::format(
          "--data-dir {}: the synthetic dataset is generated from the seed and reads no "
          "files; drop --data-dir or pick --dataset fashion-mnist|mnist",
          data_dir_flag));
    }
    return {dataset, {}, "synthetic data generated from the seed (no files)"};
  }

  if (dataset == "webdataset") {
    if (data_dir_flag.empty()) {
      throw InvalidArgument("--dataset webdataset needs --data-dir: a folder holding train/ (and val/) with .tar "
                            "shards, a folder of shards, or a pattern such as 'shards/train-{000000..000146}.tar'");
    }
    return {dataset, data_dir_flag, fmt::format("webdataset shards from {} (--data-dir)", data_dir_flag)};
  }
  std::error_code ec;
  if (!data_dir_flag.empty()) {
    const fs::path dir(data_dir_flag);
    if (!fs::is_directory(dir, ec)) {
      const bool exists = fs::exists(dir, ec);
      throw IoError(fmt::format("--data-dir {}: expected a directory with {}, found {}", data_dir_flag,
                                expected_files(dataset),
                                !exists ? "no such directory"
                                : fs::is_regular_file(dir, ec) ? "a regular file"
                                                               : "something that is not a directory"));
    }
    const std::vector<std::string> missing = missing_dataset_files(dataset, dir);
    if (!missing.empty()) {
      throw IoError(fmt::format("--data-dir {}: expected {}, missing {}", data_dir_flag, expected_files(dataset),
                                fmt::join(missing, ", ")));
    }
    return {dataset, dir, fmt::format("{} from {} (--data-dir)", dataset, display(dir))};
  }

  if (dataset == "imagefolder") {
    throw InvalidArgument("--dataset imagefolder needs --data-dir DIR, the folder holding train/ and val/");
  }
  // Incomplete full-set directories are remembered so the log can say why they were
  // passed over (an interrupted manual copy is a common surprise).
  std::vector<std::string> incomplete;
  std::vector<std::string> folders = {dataset};
  if (dataset == "cifar10") folders.push_back("cifar-10-batches-bin");  // as the archives unpack
  if (dataset == "cifar100") folders.push_back("cifar-100-binary");
  for (const fs::path& root : data_roots) {
    for (const std::string& folder : folders) {
      const fs::path dir = root / folder;
      if (!fs::is_directory(dir, ec)) continue;
      const std::vector<std::string> missing = missing_dataset_files(dataset, dir);
      if (missing.empty()) {
        return {dataset, dir, fmt::format("{} from {} (full set)", dataset, display(dir))};
      }
      incomplete.push_back(fmt::format("{} lacks {}", display(dir), fmt::join(missing, ", ")));
    }
  }
  const std::string incomplete_note =
      incomplete.empty() ? "" : fmt::format("; {}", fmt::join(incomplete, "; "));

  if (dataset == "fashion-mnist") {
    for (const fs::path& root : data_roots) {
      const fs::path dir = root / kMiniDir;
      if (fs::is_directory(dir, ec) && missing_idx_files(dir).empty()) {
        return {dataset, dir,
                fmt::format("fashion-mnist-mini from {} (the shipped slice: first 6,000 train "
                            "and 1,000 test images; run scripts/get-data.sh fashion-mnist for "
                            "the full set){}",
                            display(dir), incomplete_note)};
      }
    }
    throw IoError(fmt::format(
        "fashion-mnist: expected data/fashion-mnist or the shipped data/{} under {}, found "
        "neither{}; run scripts/get-data.sh fashion-mnist or pass --data-dir",
        kMiniDir, roots_str(data_roots), incomplete_note));
  }
  if (is_cifar(dataset)) {
    throw IoError(fmt::format(
        "{}: expected data/{} or data/{} with {} under {}, found none{}; unpack the binary version from "
        "https://www.cs.toronto.edu/~kriz/cifar.html there, or pass --data-dir",
        dataset, folders[0], folders[1], expected_files(dataset), roots_str(data_roots), incomplete_note));
  }
  throw IoError(fmt::format(
      "{}: expected data/{} with the four IDX files under {}, found none{}; run "
      "scripts/get-data.sh {} or pass --data-dir",
      dataset, dataset, roots_str(data_roots), incomplete_note, dataset));
}

void require_folder_options_apply(const std::string& dataset, const ImageFolderOptions& folder) {
  if (dataset == "imagefolder" || dataset == "webdataset") return;
  const char* flag = folder.skip_bad_files ? "--skip-bad-images" : folder.resizes() ? "--resize" : nullptr;
  if (flag != nullptr) {
    throw InvalidArgument(fmt::format("{} applies to --dataset imagefolder or webdataset, not to {}", flag, dataset));
  }
}

DatasetSplits load_splits(const DataSource& source, const SyntheticOptions& synthetic,
                          const ImageFolderOptions& folder, const StreamedSplitsOptions& shards) {
  require_folder_options_apply(source.dataset, folder);
  if (source.dataset == "synthetic") return make_synthetic_splits(synthetic);
  if (source.dataset == "webdataset") return load_webdataset_splits(source.dir.string(), shards);
  if (is_cifar(source.dataset)) return load_cifar_splits(source.dir, source.dataset);
  if (source.dataset == "imagefolder") {
    return shards.streamed() ? load_image_folder_streamed(source.dir, shards) : load_image_folder_splits(source.dir, folder);
  }
  return load_idx_splits(source.dir, source.dataset);
}

}  // namespace mtrain::data
