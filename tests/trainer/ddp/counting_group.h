// A ProcessGroup that forwards every operation to a real group and counts them, for
// tests that check which group a caller used (Note [Control-plane collectives] in
// trainer/ddp/training_groups.cpp).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "collectives/process_group.h"

namespace mtrain::testing {

class CountingGroup final : public ProcessGroup {
 public:
  explicit CountingGroup(std::shared_ptr<ProcessGroup> inner)
      : ProcessGroup(inner->rank(), inner->size(), inner->options()), inner_(std::move(inner)) {}
  std::string backend_name() const override { return inner_->backend_name(); }
  WorkPtr allreduce(Tensor& t, ReduceOp op) override {
    ++allreduces;
    return inner_->allreduce(t, op);
  }
  WorkPtr broadcast(Tensor& t, int root) override {
    ++broadcasts;
    return inner_->broadcast(t, root);
  }
  WorkPtr allgather(const Tensor& in, Tensor& out) override {
    ++allgathers;
    return inner_->allgather(in, out);
  }
  WorkPtr allgatherv(const Tensor& in, Tensor& out, const std::vector<int64_t>& counts) override {
    ++others;
    return inner_->allgatherv(in, out, counts);
  }
  WorkPtr reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    ++others;
    return inner_->reduce_scatter(in, out, op);
  }
  WorkPtr barrier() override {
    ++others;
    return inner_->barrier();
  }

  int allreduces = 0;
  int broadcasts = 0;
  int allgathers = 0;
  int others = 0;  // allgatherv, reduce_scatter, barrier

 private:
  std::shared_ptr<ProcessGroup> inner_;
};

}  // namespace mtrain::testing
