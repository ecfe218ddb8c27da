#include "trainer/checkpoint/weights.h"

#include <unistd.h>

#include <filesystem>
#include <set>

#include "core/error.h"

namespace mtrain {

namespace {

// "a, b, c and 7 more": a mismatch between a file and a model can name hundreds of
// tensors, and the first few say what went wrong.
std::string name_list(const std::vector<std::string>& names) {
  constexpr size_t kShown = 5;
  std::vector<std::string> shown(names.begin(), names.begin() + std::min(names.size(), kShown));
  std::string s = fmt::format("{}", fmt::join(shown, ", "));
  if (names.size() > kShown) s += fmt::format(" and {} more", names.size() - kShown);
  return s;
}

}  // namespace

NamedTensors model_state(models::Module& model) {
  NamedTensors state;
  for (const auto& p : model.parameters()) state.emplace_back(p.name, p.param->value);
  for (const auto& b : model.buffers()) state.emplace_back(b.name, *b.buffer);
  return state;
}

NamedTensors on_host(const NamedTensors& state) {
  NamedTensors host;
  host.reserve(state.size());
  for (const auto& [name, t] : state) host.emplace_back(name, t.to(Device::cpu()));
  return host;
}

void save_model_weights(const std::string& path, models::Module& model,
                        const SafetensorsMetadata& metadata) {
  save_safetensors(path, on_host(model_state(model)), metadata);
}

void save_model_weights_or_keep(const std::string& path, models::Module& model,
                                const SafetensorsMetadata& metadata) {
  try {
    save_model_weights(path, model, metadata);
  } catch (const IoError& failed) {
    std::error_code ec;
    const std::filesystem::path dir = std::filesystem::temp_directory_path(ec);
    const std::string kept = ((ec ? std::filesystem::path("/tmp") : dir) /
                              fmt::format("mtrain-final-{}.safetensors", ::getpid()))
                                 .string();
    try {
      save_model_weights(kept, model, metadata);
    } catch (const IoError& also) {
      throw IoError(fmt::format("{}; keeping the weights in {} failed too: {}", failed.what(), kept, also.what()));
    }
    throw IoError(fmt::format("{}; the weights are kept in {} instead", failed.what(), kept));
  }
}

void load_state_into(const SafetensorsFile& file, const NamedTensors& destinations,
                     const std::string& path) {
  std::vector<std::string> missing, mismatched, unexpected;
  std::set<std::string> expected;
  for (const auto& [name, dst] : destinations) {
    expected.insert(name);
    const Tensor src = file.find(name);
    if (!src.defined()) {
      missing.push_back(name);
    } else if (src.shape() != dst.shape() || src.dtype() != dst.dtype()) {
      mismatched.push_back(fmt::format("{} (file {} {}, model {} {})", name, dtype_name(src.dtype()),
                                       shape_str(src.shape()), dtype_name(dst.dtype()),
                                       shape_str(dst.shape())));
    }
  }
  for (const auto& [name, t] : file.tensors) {
    if (expected.count(name) == 0) unexpected.push_back(name);
  }
  if (!missing.empty() || !mismatched.empty() || !unexpected.empty()) {
    std::vector<std::string> problems;
    if (!missing.empty()) problems.push_back(fmt::format("missing {}", name_list(missing)));
    if (!mismatched.empty()) problems.push_back(fmt::format("mismatched {}", name_list(mismatched)));
    if (!unexpected.empty()) problems.push_back(fmt::format("unexpected {}", name_list(unexpected)));
    const auto saved_model = file.metadata.find(kWeightsModelKey);
    const std::string hint = saved_model != file.metadata.end()
                                 ? fmt::format("the file holds --model {} weights", saved_model->second)
                                 : std::string("was it saved from another model?");
    throw IoError(fmt::format("weights file {} does not fit the model: {} ({})", path,
                              fmt::join(problems, "; "), hint));
  }
  for (const auto& [name, dst] : destinations) {
    Tensor target = dst;  // a handle: copy_ writes into the model's storage
    target.copy_(file.find(name));
  }
}

void load_model_weights(const std::string& path, models::Module& model) {
  load_state_into(load_safetensors(path), model_state(model), path);
}

}  // namespace mtrain
