// Test helpers for the Reducer and the StepExchange: a small model, its inputs and gradients, a
// rank over real Gloo groups, and two such ranks on two threads of this process.
#pragma once

#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "store/store.h"
#include "models/linear.h"
#include "models/sequential.h"
#include "trainer/ddp/reducer.h"
#include "trainer/ddp/step_exchange.h"
#include "trainer/ddp/training_groups.h"

namespace mtrain::testing {

// Three Linear(100, 100): weights of 40,000 bytes, biases of 400.
inline std::unique_ptr<models::Sequential> three_linears() {
  auto m = std::make_unique<models::Sequential>();
  for (int i = 0; i < 3; ++i) m->append(std::make_unique<models::Linear>(100, 100));
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  for (auto& p : m->parameters()) {
    float* v = p.param->value.data<float>();
    for (int64_t k = 0; k < p.param->value.numel(); ++k) v[k] = 0.1f * normal(gen);
  }
  return m;
}

inline Tensor random_input(int64_t rows) {
  Tensor x = Tensor::empty({rows, 100});
  std::mt19937 gen(11);
  std::normal_distribution<float> normal;
  for (int64_t k = 0; k < x.numel(); ++k) x.data<float>()[k] = normal(gen);
  return x;
}

inline std::vector<std::vector<float>> gradients(models::Module& m) {
  std::vector<std::vector<float>> out;
  for (auto& p : m.parameters()) out.push_back(p.param->grad.to_vector<float>());
  return out;
}

// One forward and backward of `m` on 4 rows with `sync` around the backward; a synchronized
// one sends an empty record on `exchange` where it is given, as the CPU loop does.
inline void step(models::Module& m, GradientSynchronizer& sync, bool synchronize, StepExchange* exchange = nullptr) {
  const Tensor x = random_input(4);
  const Tensor y = m.forward(x);
  MicroBatchInfo info{4, synchronize};
  info.world_samples = 4;
  sync.before_backward(info);
  if (exchange != nullptr && synchronize) exchange->issue({}, info, sync.last_wait_ns());
  m.backward(Tensor::full(y.shape(), 0.25f));
  sync.after_backward();
  if (exchange != nullptr && synchronize) exchange->finish();
}

// One of two ranks training three_linears() with a Reducer and a StepExchange over real Gloo
// groups (10 s timeouts, unless given); the groups outlive both.
struct GlooRank {
  GlooRank(int rank, std::shared_ptr<Store> store, ReducerOptions o = {}, Millis timeout = Millis(10000))
      : groups(create_training_groups("gloo", std::move(store), rank, 2, Device::cpu(), with_timeout(timeout))),
        model(three_linears()),
        reducer(groups.gradients, o, groups.control),
        exchange(groups.control, Device::cpu()) {
    reducer.attach(*model);
  }
  static ProcessGroupOptions with_timeout(Millis timeout) {
    ProcessGroupOptions options;
    options.timeout = timeout;
    return options;
  }

  const TrainingGroups groups;
  std::unique_ptr<models::Sequential> model;
  Reducer reducer;
  StepExchange exchange;
};

// Runs body(rank, store) for ranks 0 and 1 on two threads, each with its own client of
// one store server (10 s timeouts), as two processes would; returns what each rank
// threw ("" when it returned).
inline std::vector<std::string> on_two_ranks(const std::function<void(int, std::shared_ptr<Store>)>& body) {
  TcpStoreServer server("127.0.0.1", 0, "token");
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        body(r, std::make_shared<TcpStore>("127.0.0.1", server.port(), "token", Millis(10000)));
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  return errors;
}

}  // namespace mtrain::testing
