#include "launcher/worker_env.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <map>

extern char** environ;

namespace mtrain::launch {

std::vector<std::string> current_environment() {
  std::vector<std::string> out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) out.emplace_back(*e);
  return out;
}

std::vector<std::string> build_worker_environment(const std::vector<std::string>& base,
                                                  const WorkerEnvInputs& in) {
  // Ordered so that the worker's environment is deterministic (easier to diff in logs).
  std::map<std::string, std::string> set;
  const auto put = [&](const char* key, const std::string& value) { set[key] = value; };
  const auto num = [](int v) { return std::to_string(v); };

  put("RANK", num(in.global_rank));
  put("LOCAL_RANK", num(in.local_rank));
  put("WORLD_SIZE", num(in.world_size));
  put("LOCAL_WORLD_SIZE", num(in.local_world_size));
  put("GROUP_RANK", num(in.group_rank));
  put("GROUP_WORLD_SIZE", num(in.group_world_size));
  put("ROLE_NAME", in.role);
  // One role per job: the role rank and size are the global ones.
  put("ROLE_RANK", num(in.global_rank));
  put("ROLE_WORLD_SIZE", num(in.world_size));
  put("MASTER_ADDR", in.master_addr);
  put("MASTER_PORT", num(in.master_port));
  put("MTRAIN_STORE_ADDR", in.store_addr);
  put("MTRAIN_STORE_PORT", num(in.store_port));
  put("MTRAIN_RESTART_COUNT", num(in.restart_count));
  put("MTRAIN_MAX_RESTARTS", num(in.max_restarts));
  put("MTRAIN_RUN_ID", in.run_id);
  put("MTRAIN_ERROR_FILE", in.error_file);
  put("MTRAIN_STORE_TOKEN", in.store_token);
  put("MTRAIN_STORE_PREFIX", in.store_prefix);
  // torchrun's names, for programs written against torch.distributed.elastic.
  put("TORCHELASTIC_RESTART_COUNT", num(in.restart_count));
  put("TORCHELASTIC_MAX_RESTARTS", num(in.max_restarts));
  put("TORCHELASTIC_RUN_ID", in.run_id);
  put("TORCHELASTIC_ERROR_FILE", in.error_file);
  // Rank 0 hosts the framework's own store at MASTER_ADDR:MASTER_PORT (Note [Worker
  // rendezvous for other frameworks] in attempt.cpp), as torchrun says with this.
  put("TORCHELASTIC_USE_AGENT_STORE", "False");
  if (in.omp_num_threads > 0) put("OMP_NUM_THREADS", std::to_string(in.omp_num_threads));

  // torchrun's defaults for NCCL programs, unless the user set them.
  const auto inherited = [&](const std::string& key) {
    return std::any_of(base.begin(), base.end(), [&](const std::string& e) { return e.rfind(key + "=", 0) == 0; });
  };
  for (const char* key : {"NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}) {
    if (!inherited(key)) put(key, "1");
  }

  std::vector<std::string> out;
  out.reserve(base.size() + set.size());
  for (const std::string& entry : base) {
    const std::string key = entry.substr(0, entry.find('='));
    if (set.count(key) == 0) out.push_back(entry);
  }
  for (const auto& [key, value] : set) out.push_back(fmt::format("{}={}", key, value));
  return out;
}

}  // namespace mtrain::launch
