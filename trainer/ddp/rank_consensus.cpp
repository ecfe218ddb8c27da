#include "trainer/ddp/rank_consensus.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <utility>

#include "core/error.h"

namespace mtrain {

uint64_t fnv1a(const void* data, size_t bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = seed;
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t fnv1a(const std::string& text, uint64_t seed) { return fnv1a(text.data(), text.size(), seed); }

// Note [Consensus by hashes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Comparing whole objects across ranks would cost their size in traffic; a 64-bit FNV-1a hash per
// named item, all-gathered, costs 8 bytes per item and rank, and names which item differs on which
// ranks. Rank 0's value is the reference (it is the rank whose weights were broadcast and that
// writes the results), so the error lists the ranks that differ from rank 0; every rank raises the
// same message.
void require_same_on_all_ranks(ProcessGroup& group, const std::vector<NamedHash>& items,
                               const std::string& what) {
  const int world = group.size();
  const auto n = static_cast<int64_t>(items.size());
  // The count goes first so ranks that disagree on the number of items fail cleanly
  // instead of exchanging buffers of different sizes.
  Tensor local = Tensor::empty({n + 1}, DType::Int64);
  local.data<int64_t>()[0] = n;
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = 0;
    std::memcpy(&v, &items[i].hash, sizeof v);
    local.data<int64_t>()[i + 1] = v;
  }
  Tensor counts = Tensor::empty({world}, DType::Int64);
  Tensor count = local.narrow0(0, 1).clone();
  group.allgather(count, counts)->wait();
  std::vector<int> other_count;
  for (int r = 0; r < world; ++r) {
    if (counts.data<int64_t>()[r] != n) other_count.push_back(r);
  }
  if (!other_count.empty()) {
    throw InvalidArgument(fmt::format("{} differs across ranks: ranks {} check a different number of items than "
                                      "rank {} ({})",
                                      what, fmt::join(other_count, ", "), group.rank(), n));
  }
  Tensor all = Tensor::empty({world * (n + 1)}, DType::Int64);
  group.allgather(local, all)->wait();
  const int64_t* g = all.data<int64_t>();
  std::vector<std::string> problems;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int> differing;
    for (int r = 1; r < world; ++r) {
      if (g[r * (n + 1) + i + 1] != g[i + 1]) differing.push_back(r);
    }
    if (differing.empty()) continue;
    std::string p = fmt::format("{} on rank{} {} differs from rank 0", items[i].name, differing.size() == 1 ? "" : "s",
                                fmt::join(differing, ", "));
    if (!items[i].local_value.empty()) p += fmt::format(" (rank {} has {})", group.rank(), items[i].local_value);
    problems.push_back(std::move(p));
  }
  if (!problems.empty()) {
    throw InvalidArgument(fmt::format("{} differs across ranks: {}", what, fmt::join(problems, "; ")));
  }
}

uint64_t hash_parameters(models::Module& model) {
  uint64_t h = fnv1a("parameters");
  for (const auto& p : model.parameters()) {
    h = fnv1a(p.name, h);
    const auto& shape = p.param->value.shape();
    h = fnv1a(shape.data(), shape.size() * sizeof(shape[0]), h);
    // The bytes are hashed on the host; a GPU parameter is copied there first.
    const Tensor host = p.param->value.to(Device::cpu());
    h = fnv1a(host.raw_data(), host.nbytes(), h);
  }
  return h;
}

namespace {

using NamedTensor = std::pair<std::string, Tensor*>;

// Packs `tensors` (all of `dtype`, on one device) into one buffer there, broadcasts it
// from rank 0 and unpacks: one collective instead of one per tensor (resnet18 has ~100
// of them). The packing is Tensor::copy_, so on a GPU it is device-to-device copies.
void broadcast_flat(ProcessGroup& group, const std::vector<NamedTensor>& tensors, DType dtype) {
  if (tensors.empty()) return;
  const Device device = tensors.front().second->device();
  int64_t total = 0;
  for (const auto& [name, t] : tensors) {
    if (t->device() != device) {
      throw InvalidArgument(fmt::format("cannot broadcast the model state: {} is on {}, {} on {}; move the whole "
                                        "model with model.to(device) first",
                                        name, t->device().str(), tensors.front().first, device.str()));
    }
    total += t->numel();
  }
  if (total == 0) return;
  Tensor flat = Tensor::empty({total}, dtype, device);
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    flat.flat_view(offset, t->shape()).copy_(*t);
    offset += t->numel();
  }
  // The unpacking copies queue on the caller's stream after the broadcast; the host goes on
  // (on CPU backends this is wait()). A per-step host wait here cost the GPU its queue.
  group.broadcast(flat, 0)->wait_on_current_stream();
  offset = 0;
  for (const auto& [name, t] : tensors) {
    t->copy_(flat.flat_view(offset, t->shape()));
    offset += t->numel();
  }
}

// Broadcasts the parameters (with_parameters) and the buffers of `model` from rank 0,
// one collective per dtype.
void broadcast_from_rank0(ProcessGroup& group, models::Module& model, bool with_parameters) {
  std::vector<NamedTensor> floats;
  std::vector<NamedTensor> ints;
  if (with_parameters) {
    for (auto& p : model.parameters()) floats.emplace_back(p.name, &p.param->value);
  }
  for (auto& b : model.buffers()) {
    if (b.buffer->dtype() == DType::Float32) {
      floats.emplace_back(b.name, b.buffer);
    } else if (b.buffer->dtype() == DType::Int64) {
      ints.emplace_back(b.name, b.buffer);
    } else {
      throw InvalidArgument(fmt::format("cannot broadcast buffer {}: {} (expected float32 or int64)", b.name,
                                        b.buffer->str()));
    }
  }
  broadcast_flat(group, floats, DType::Float32);
  broadcast_flat(group, ints, DType::Int64);
}

}  // namespace

void broadcast_module_state(ProcessGroup& group, models::Module& model) {
  broadcast_from_rank0(group, model, /*with_parameters=*/true);
}

void broadcast_module_buffers(ProcessGroup& group, models::Module& model) {
  broadcast_from_rank0(group, model, /*with_parameters=*/false);
}

double sum_over_ranks(ProcessGroup& group, double value) {
  int64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  const Tensor mine = Tensor::from_vector<int64_t>({bits}, {1});
  Tensor all = Tensor::empty({group.size()}, DType::Int64);
  group.allgather(mine, all)->wait();
  double sum = 0.0;
  for (int64_t b : all.to_vector<int64_t>()) {
    double v = 0.0;
    std::memcpy(&v, &b, sizeof v);
    sum += v;
  }
  return sum;
}

}  // namespace mtrain
